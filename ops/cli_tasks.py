"""`rollout tasks validate|preview|publish FILE`: check, look at and publish a user's task file.

All read the file through :mod:`engine.tasks`, the same reader the scheduler uses, so a file that
validates here is one the scheduler accepts. ``validate`` exits 1 on the first bad row, naming the file,
line and field; ``preview`` renders the first few prompts with a model's chat template; ``publish``
validates, then sends every task to ``<ns>.rollout.tasks.published`` (key: the task's id), where
schedulers with ``scheduler.published_tasks = true`` pick them up. Ids already on that topic are refused
by name (nothing is published; ``--skip-published`` publishes the others).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.tasks import TaskFile, UserTask

DEFAULT_MODEL = Path.home() / ".cache" / "rollout-engine" / "models" / "smollm2-135m-instruct"


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND")
    sub.required = True
    for name, help_text, func in (("validate", "check a task file (JSONL, Parquet or saved HF dataset dir)", _validate),
                                  ("preview", "render the first prompts of a task file with a chat template", _preview),
                                  ("publish", "validate a task file and publish its tasks to a deployment's schedulers",
                                   _publish)):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("file")
        p.add_argument("--domain", help="default domain for rows that name none")
        p.add_argument("--map", action="append", default=[], metavar="FIELD=COLUMN",
                       help="read task FIELD from the file's COLUMN (repeatable), e.g. --map prompt=question; or a "
                            "constant (--map domain=const:math) or a template (--map 'prompt={question}\\n{hint}')")
        p.set_defaults(func=func)
        if name == "preview":
            p.add_argument("-n", type=int, default=3, help="how many tasks to render (default 3)")
            p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory whose chat template to use")
        if name == "publish":
            p.add_argument("--config", required=True, help="the deployment's TOML config (Kafka and namespace)")
            p.add_argument("--skip-published", action="store_true",
                           help="publish the tasks whose ids are new and name the others (default: refuse all)")
            p.add_argument("--idle-s", type=float, default=2.0,
                           help="reading the ids already published ends after this long without a record")


def _mapping(pairs: list[str]) -> dict[str, str]:
    from engine.tasks import parse_mapping

    try:
        return parse_mapping(pairs)
    except ValueError as exc:
        raise SystemExit(f"rollout tasks: {exc}") from None


def _load(args: argparse.Namespace, command: str) -> "TaskFile | None":
    """The task file, or None after printing its first error as ``rollout tasks COMMAND: ...``."""
    from domains import DOMAINS
    from engine.tasks import TaskFile, TaskFileError

    try:
        return TaskFile(args.file, known_domains=DOMAINS, default_domain=args.domain, mapping=_mapping(args.map))
    except TaskFileError as exc:
        print(f"rollout tasks {command}: {exc}", file=sys.stderr)
        return None


def _validate(args: argparse.Namespace) -> int:
    from collections import Counter

    tf = _load(args, "validate")
    if tf is None:
        return 1
    per_domain = Counter(t.domain for t in tf.tasks)
    layout = f", {tf.layout.name} layout" if tf.layout is not None else ""
    print(f"{tf.path}: {len(tf.tasks)} tasks OK ({', '.join(f'{d} {n}' for d, n in sorted(per_domain.items()))}{layout})")
    return 0


def _preview(args: argparse.Namespace) -> int:
    tf = _load(args, "preview")
    if tf is None:
        return 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    for task in tf.tasks[: args.n]:
        messages = list(task.messages) or [{"role": "user", "content": task.prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        print(f"--- {task.id} [{task.domain}] verify: {sorted(task.spec)}")
        print(text)
    return 0


def _publish(args: argparse.Namespace) -> int:
    import anyio

    from engine.config import ConfigError, load_config
    from streams.protocols import TransportError

    tf = _load(args, "publish")
    if tf is None:
        return 1
    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as exc:
        print(f"rollout tasks publish: {exc}", file=sys.stderr)
        return 1
    try:
        published, refused, topic = anyio.run(lambda: publish_tasks(cfg, tf.tasks, source=str(tf.path),
                                                                    skip_published=args.skip_published,
                                                                    idle_s=args.idle_s))
    except TransportError as exc:
        print(f"rollout tasks publish: cannot reach Kafka at {cfg.kafka.bootstrap}: {exc}", file=sys.stderr)
        return 1
    shown = ", ".join(refused[:20]) + (f", ... ({len(refused) - 20} more)" if len(refused) > 20 else "")
    if refused and not args.skip_published:
        print(f"rollout tasks publish: refused: {len(refused)} task id(s) already published to {topic}: {shown}; "
              "nothing published (--skip-published publishes the others)", file=sys.stderr)
        return 1
    print(f"{tf.path}: {published} tasks published to {topic}"
          + (f"; {len(refused)} skipped, already published: {shown}" if refused else ""))
    return 0


async def published_ids(cfg: "EngineConfig", *, idle_s: float = 2.0) -> set[str]:
    """The ids of every task on the deployment's ``rollout.tasks.published`` topic (read to its end)."""
    from engine.schemas import PublishedTask
    from engine.topics import Names
    from streams.kafka import Consumer

    ids: set[str] = set()
    async with Consumer(cfg.kafka, assign_topics=[Names(cfg.namespace).published_tasks],
                        expect=(PublishedTask.SCHEMA,)) as consumer:
        while records := await consumer.getmany(timeout_s=idle_s):
            ids.update(r.message.id for r in records if isinstance(r.message, PublishedTask))
    return ids


async def publish_tasks(cfg: "EngineConfig", tasks: Sequence["UserTask"], *, source: str = "",
                        skip_published: bool = False, idle_s: float = 2.0) -> tuple[int, list[str], str]:
    """Publish ``tasks`` (validated :class:`engine.tasks.UserTask` rows) unless their ids are already on the
    topic; returns (how many published, the refused ids, the topic). With refused ids and not
    ``skip_published``, nothing is published."""
    from actors.runtime import Runtime
    from engine.schemas import PublishedTask

    async with Runtime(cfg, use_nats=False) as rt:  # creates the deployment's topics if missing
        topic = rt.names.published_tasks
        already = await published_ids(cfg, idle_s=idle_s)
        refused = [t.id for t in tasks if t.id in already]
        if refused and not skip_published:
            return 0, refused, topic
        futures = []
        for t in tasks:
            if t.id in already:
                continue
            msg = PublishedTask(id=t.id, domain=t.domain, prompt=t.prompt, spec=dict(t.spec),
                                max_turns=t.max_turns or 0, source=source, metadata=dict(t.metadata))
            await rt.producer.wait_room()
            futures.append(rt.producer.send_nowait(topic, msg, key=t.id)[0])
        for fut in futures:
            await fut
        return len(futures), refused, topic
