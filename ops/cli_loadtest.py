"""`rollout loadtest sandboxes ...` and `rollout loadtest soak ...`."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

def _load(name: str) -> ModuleType:
    """A benchmark body from the ``loadtests`` package (imported lazily: it pulls in heavy modules)."""
    return importlib.import_module(f"loadtests.{name}")


def register(parser: argparse.ArgumentParser) -> None:
    from sandboxes.registry import sandbox_backend_names

    sub = parser.add_subparsers(dest="loadtest_command", metavar="SUBCOMMAND")
    sub.required = True
    sb = sub.add_parser("sandboxes", help="acquire+exec+release cycles vs `docker run` in the same run")
    sb.add_argument("--backend", choices=sandbox_backend_names(), default="bwrap")
    sb.add_argument("--concurrency", type=int, default=4)
    sb.add_argument("--duration", type=float, default=20.0, help="seconds of measured cycles")
    sb.add_argument("--quick", action="store_true", help="a smoke run (5 s, 5 docker runs)")
    sb.add_argument("--json", type=Path, default=None, help="write the figures as one flat JSON object")
    sb.add_argument("--no-docker-baseline", action="store_true",
                    help="skip the `docker run` baseline (it is skipped anyway when no Docker engine answers)")
    sb.add_argument("--open", type=int, default=None, metavar="N",
                    help="then open N sandboxes at once and report the memory they take (default 20; 10 with --quick; 0: skip)")
    sb.set_defaults(func=_sandboxes)

    soak = sub.add_parser("soak", help="sandbox sessions through the sandbox role with Kafka in the loop; leak checks")
    soak.add_argument("--duration", type=float, default=1800.0, help="seconds of measured soak after the warm-up")
    soak.add_argument("--sessions", type=int, default=1000, help="concurrent sandbox sessions")
    soak.add_argument("--quick", action="store_true", help="a smoke run (60 s, at most 100 sessions)")
    soak.add_argument("--json", type=Path, default=None, help="write the figures as one flat JSON object")
    soak.set_defaults(func=_soak)


def _sandboxes(args: argparse.Namespace) -> int:
    body = _load("sandboxes")
    from sandboxes.docker_backend import engine_available

    engine = engine_available() if (args.backend == "docker" or not args.no_docker_baseline) else False
    if args.backend == "docker" and not engine:
        print("rollout loadtest sandboxes: --backend docker needs a Docker engine (DOCKER_HOST or "
              "/var/run/docker.sock); start one with `rollout infra up --docker`", file=sys.stderr)
        return 2
    if args.no_docker_baseline:
        skipped = "--no-docker-baseline"
    elif not engine:
        skipped = "no Docker engine answers (DOCKER_HOST or /var/run/docker.sock)"
        print(f"rollout loadtest sandboxes: `docker run` baseline skipped: {skipped}", file=sys.stderr)
    else:
        skipped = None
    count = args.open if args.open is not None else (10 if args.quick else 20)
    figures = asyncio.run(body.run(args.backend, args.concurrency, args.duration, args.quick, skipped, count))
    print(body.table(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 1 if figures["failures"] else 0


def _soak(args: argparse.Namespace) -> int:
    body = _load("soak")
    figures = body.run(args.duration, args.sessions, args.quick)
    print(body.table(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    leaked = (figures["leaked_processes"] + figures["leaked_mounts"] + figures["leaked_cgroups"]
              + figures["leaked_owner_files"])
    return 1 if leaked or abs(figures.get("leaked_fds", 0)) > 8 or figures.get("rss_growth_fraction", 0) > 0.05 else 0
