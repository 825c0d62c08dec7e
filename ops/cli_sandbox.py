"""`rollout sandbox exec [--backend B] [--timeout S] [--memory MB] [--pids N] -- CMD...`"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys


def register(parser: argparse.ArgumentParser) -> None:
    from sandboxes.registry import sandbox_backend_names

    sub = parser.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND")
    sub.required = True
    ex = sub.add_parser("exec", help="run one command in a fresh sandbox; prints one JSON ExecResult")
    ex.add_argument("--backend", choices=sandbox_backend_names(), default="bwrap")
    ex.add_argument("--timeout", type=float, default=30.0, help="wall-clock seconds (default 30)")
    ex.add_argument("--memory", type=int, default=512, help="memory limit in MB (default 512)")
    ex.add_argument("--pids", type=int, default=128, help="process limit (default 128)")
    ex.add_argument("--stdin", action="store_true", help="pass this process's stdin to the command")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    ex.set_defaults(func=_exec)
    reap = sub.add_parser("reap", help="remove leftovers (cgroups, workspaces, processes) of dead sandboxes")
    reap.set_defaults(func=_reap)


def _exec(args: argparse.Namespace) -> int:
    from sandboxes import Limits, open_sandbox

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("rollout sandbox exec: no command (usage: rollout sandbox exec -- CMD...)", file=sys.stderr)
        return 2
    limits = Limits(memory_mb=args.memory, pids=args.pids, timeout_s=args.timeout)
    stdin = sys.stdin.buffer.read() if args.stdin else None

    async def run() -> dict[str, object]:
        async with open_sandbox(args.backend, limits) as sandbox:
            result = await sandbox.exec(cmd, stdin=stdin, timeout=args.timeout)
        return dataclasses.asdict(result)

    print(json.dumps(asyncio.run(run())))
    return 0


def _reap(args: argparse.Namespace) -> int:
    from sandboxes.bwrap import reap

    report = reap()
    print(json.dumps(dataclasses.asdict(report)))
    return 0
