"""`rollout tasks validate FILE` / `rollout tasks preview FILE`: check and look at a user's task file.

Both read the file through :mod:`engine.tasks`, the same reader the scheduler uses, so a file that
validates here is one the scheduler accepts. ``validate`` exits 1 on the first bad row, naming the file,
line and field; ``preview`` renders the first few prompts with a model's chat template.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "rollout-engine" / "models" / "smollm2-135m-instruct"


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND")
    sub.required = True
    for name, help_text, func in (("validate", "check a task file (JSONL, Parquet or saved HF dataset dir)", _validate),
                                  ("preview", "render the first prompts of a task file with a chat template", _preview)):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("file")
        p.add_argument("--domain", help="default domain for rows that name none")
        p.add_argument("--map", action="append", default=[], metavar="FIELD=COLUMN",
                       help="read task FIELD from the file's COLUMN (repeatable), e.g. --map prompt=question")
        p.set_defaults(func=func)
        if name == "preview":
            p.add_argument("-n", type=int, default=3, help="how many tasks to render (default 3)")
            p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory whose chat template to use")


def _mapping(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        field, sep, column = pair.partition("=")
        if not sep or not field or not column:
            raise SystemExit(f"rollout tasks: --map wants FIELD=COLUMN, got {pair!r}")
        out[field] = column
    return out


def _load(args: argparse.Namespace):
    from actors.domains import DOMAINS
    from engine.tasks import TaskFile

    return TaskFile(args.file, known_domains=DOMAINS, default_domain=args.domain, mapping=_mapping(args.map))


def _validate(args: argparse.Namespace) -> int:
    from collections import Counter

    from engine.tasks import TaskFileError

    try:
        tf = _load(args)
    except TaskFileError as exc:
        print(f"rollout tasks validate: {exc}", file=sys.stderr)
        return 1
    per_domain = Counter(t.domain for t in tf.tasks)
    print(f"{tf.path}: {len(tf.tasks)} tasks OK ({', '.join(f'{d} {n}' for d, n in sorted(per_domain.items()))})")
    return 0


def _preview(args: argparse.Namespace) -> int:
    from engine.tasks import TaskFileError

    try:
        tf = _load(args)
    except TaskFileError as exc:
        print(f"rollout tasks preview: {exc}", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    for task in tf.tasks[: args.n]:
        messages = list(task.messages) or [{"role": "user", "content": task.prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        print(f"--- {task.id} [{task.domain}] verify: {sorted(task.spec)}")
        print(text)
    return 0
