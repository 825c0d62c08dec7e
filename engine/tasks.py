"""Users' own task files: reading, field mapping, validation, weighted mixing and sharding.

Pure logic (no Kafka/NATS): the scheduler wraps a :class:`TaskFile` as a task source and the
``rollout tasks`` CLI validates and previews with it, so both read a file the same way and a bad row
gets the same error (file, line, field) in both places.

Formats: JSONL (``.jsonl``/``.json``), Parquet (``.parquet``) and a Hugging Face ``datasets``
directory written by ``Dataset.save_to_disk`` (a directory). Rows are numbered from 1 in file order;
for JSONL the row number is the line number.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

TASK_FIELDS = ("id", "domain", "prompt", "messages", "answer", "tests", "files", "metadata", "max_turns", "spec")
"""The canonical fields of a task row; a field mapping renames a file's columns onto these."""


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file, the row (line) and the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class UserTask:
    """One validated task row. ``spec`` is what the domain's verifier reads (answer, tests, files)."""

    id: str
    domain: str
    prompt: str
    spec: dict[str, Any]
    messages: tuple[dict[str, str], ...] = ()
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int | None = None
    row: int = 0


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, raw_row)`` from a JSONL file, a Parquet file or a saved HF dataset directory."""
    p = Path(path)
    if not p.exists():
        raise TaskFileError(f"{p}: no such file or directory")
    if p.is_dir():
        yield from _read_hf_dir(p)
    elif p.suffix == ".parquet":
        yield from _read_parquet(p)
    else:
        yield from _read_jsonl(p)


def _read_jsonl(p: Path) -> Iterator[tuple[int, Any]]:
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{p}:{lineno}: malformed JSON: {exc.msg} (column {exc.colno})") from None


def _read_parquet(p: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise TaskFileError(f"{p}: not a readable Parquet file: {exc}") from None
    for i, row in enumerate(table.to_pylist(), 1):
        yield i, row


def _read_hf_dir(p: Path) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:
        raise TaskFileError(f"{p}: not a saved Hugging Face dataset directory: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise TaskFileError(f"{p}: a DatasetDict with splits {sorted(ds)}; save one split")
        ds = next(iter(ds.values()))
    for i, row in enumerate(ds, 1):
        yield i, row


def parse_mapping(pairs: Iterable[str]) -> dict[str, str]:
    """``FIELD=COLUMN`` strings (the CLIs' ``--map``) -> a field mapping; ValueError naming a malformed one."""
    out: dict[str, str] = {}
    for pair in pairs:
        field, sep, column = pair.partition("=")
        if not sep or not field or not column:
            raise ValueError(f"--map wants FIELD=COLUMN, got {pair!r}")
        out[field] = column
    return out


def apply_mapping(row: Mapping[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """Rename ``row``'s columns: ``mapping`` is canonical field -> the file's column name."""
    if not mapping:
        return dict(row)
    by_column = {column: field for field, column in mapping.items()}
    return {by_column.get(k, k): v for k, v in row.items()}


def parse_row(raw: Any, where: str, *, known_domains: Iterable[str], default_domain: str | None = None,
              mapping: Mapping[str, str] | None = None) -> UserTask:
    """One raw row -> a :class:`UserTask`, or a :class:`TaskFileError` naming ``where`` and the field."""
    if not isinstance(raw, Mapping):
        raise TaskFileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    row = {k: v for k, v in apply_mapping(raw, mapping or {}).items() if v is not None}
    unknown = sorted(set(row) - set(TASK_FIELDS))
    if unknown:
        raise TaskFileError(f"{where}: unknown field(s) {unknown}; known: {list(TASK_FIELDS)} "
                            "(map other columns with a field mapping)")
    domain = row.get("domain", default_domain)
    if not domain:
        raise TaskFileError(f"{where}: field 'domain' is missing (and the source names no default domain)")
    known = set(known_domains)
    if domain not in known:
        raise TaskFileError(f"{where}: field 'domain': unknown domain {domain!r}; known: {sorted(known)}")
    messages = row.get("messages") or []
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "content" in m for m in messages):
        raise TaskFileError(f"{where}: field 'messages': expected a list of {{role, content}} objects")
    prompt = row.get("prompt")
    if prompt is None and messages:
        users = [m["content"] for m in messages if m.get("role", "user") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskFileError(f"{where}: field 'prompt' (or 'messages' with a user turn) is missing or empty")
    spec = dict(row.get("spec") or {})
    if "answer" in row:
        spec["answer"] = str(row["answer"])
    if "tests" in row:
        if not isinstance(row["tests"], list):
            raise TaskFileError(f"{where}: field 'tests': expected a list")
        spec["tests"] = row["tests"]
    if "files" in row:
        if not isinstance(row["files"], Mapping):
            raise TaskFileError(f"{where}: field 'files': expected an object of path -> content")
        spec["files"] = dict(row["files"])
    if not any(k in spec for k in ("answer", "tests", "checks", "goals")):
        raise TaskFileError(f"{where}: field 'answer' is missing (a task needs an answer, tests or a spec to verify)")
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise TaskFileError(f"{where}: field 'metadata': expected an object")
    max_turns = row.get("max_turns")
    if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
        raise TaskFileError(f"{where}: field 'max_turns': expected a positive integer")
    return UserTask(id=str(row.get("id", "")), domain=domain, prompt=prompt, spec=spec,
                    messages=tuple(dict(m) for m in messages), metadata=dict(metadata), max_turns=max_turns)


class TaskFile:
    """A validated task file: rows in order, ids unique (a row without an id gets ``<file>:<row>``)."""

    def __init__(self, path: str | Path, *, known_domains: Iterable[str], default_domain: str | None = None,
                 mapping: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self.tasks: list[UserTask] = []
        seen: dict[str, int] = {}
        known = list(known_domains)
        for n, raw in read_rows(self.path):
            where = f"{self.path}:{n}"
            task = parse_row(raw, where, known_domains=known, default_domain=default_domain, mapping=mapping)
            task_id = task.id or f"{self.path.name}:{n}"
            if task_id in seen:
                raise TaskFileError(f"{where}: field 'id': duplicate id {task_id!r} (first on row {seen[task_id]})")
            seen[task_id] = n
            self.tasks.append(dataclasses.replace(task, id=task_id, row=n))
        if not self.tasks:
            raise TaskFileError(f"{self.path}: no tasks")


def shard(tasks: Sequence[UserTask], replica: int, replicas: int) -> list[UserTask]:
    """Replica ``replica`` of ``replicas`` takes every ``replicas``-th task: disjoint shares covering all."""
    if replicas < 1 or not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} of {replicas}: need 0 <= replica < replicas")
    return list(tasks[replica::replicas])


class WeightedMix:
    """Draw from several finite task lists by weight, in a seeded and therefore resumable order.

    The position is one integer per source (how many tasks each has issued), so a restart that restores
    :attr:`positions` continues exactly: no task issued twice, none skipped. An exhausted source drops
    out of the draw; :meth:`next` returns None when all are exhausted.
    """

    def __init__(self, sources: Mapping[str, Sequence[UserTask]], weights: Mapping[str, float], *, seed: int = 0,
                 positions: Mapping[str, int] | None = None) -> None:
        bad = {k: w for k, w in weights.items() if w <= 0}
        if bad:
            raise ValueError(f"source weights must be positive: {bad}")
        self._sources = {k: list(v) for k, v in sources.items()}
        self._weights = {k: float(weights.get(k, 1.0)) for k in self._sources}
        self._seed = seed
        self.positions: dict[str, int] = {k: int((positions or {}).get(k, 0)) for k in self._sources}

    def next(self) -> tuple[str, UserTask] | None:
        live = [k for k in sorted(self._sources) if self.positions[k] < len(self._sources[k])]
        if not live:
            return None
        # The draw depends only on the seed and the positions, so it replays identically after a restart.
        rng = random.Random(f"{self._seed}:" + ",".join(f"{k}={self.positions[k]}" for k in sorted(self.positions)))
        name = rng.choices(live, weights=[self._weights[k] for k in live])[0]
        task = self._sources[name][self.positions[name]]
        self.positions[name] += 1
        return name, task
