"""`rollout`: the one command-line entry point.

Each sub-command lives in its own module and exposes ``register(subparsers)``; modules are imported
only when their command runs, so `rollout infra status` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> (module, one-line help). The module's ``register(parser)`` adds its arguments and
# sub-commands and sets ``func`` (a callable taking the parsed args and returning an exit code).
COMMANDS: dict[str, tuple[str, str]] = {
    "infra": ("ops.cli_infra", "start, stop and inspect the local Kafka / NATS / Docker / bubblewrap stack"),
    "run": ("ops.cli_run", "run the configured roles as a daemon (all roles by default)"),
    "status": ("ops.cli_status", "live view of a running deployment"),
    "sandbox": ("ops.cli_sandbox", "run commands in isolated sandboxes"),
    "inference": ("ops.cli_inference", "serve the local SGLang-protocol inference backend"),
    "loadtest": ("ops.cli_loadtest", "load tests: sandboxes, soak"),
    "model": ("ops.cli_model", "prepare real models (fetch, convert, cache) and check model directories"),
    "demo": ("ops.cli_demo", "the main job: a short real RL run on the local stack"),
    "export": ("ops.cli_export", "export trajectories from the experience log to JSONL (filtered, resumable)"),
    "eval": ("ops.cli_eval", "evaluate a fixed policy on held-out tasks: completion rate, pass@k (table, JSON, Markdown)"),
    "domains": ("ops.cli_domains", "list the task domains: built-in, plugins, reasoning-gym families, benchmarks"),
    "tasks": ("ops.cli_tasks", "validate and preview users' task files (JSONL, Parquet, HF datasets)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is not None and name != only:
            continue
        importlib.import_module(module_name).register(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the module of the command being run (the first non-option argument).
    only = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only if only in COMMANDS else None)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
