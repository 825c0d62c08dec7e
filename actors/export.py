"""Export trajectories from the ``rollout.experience`` log to JSONL, filtered and resumable.

Why a position file: an export of a long run is interrupted (disk full, ^C) and re-run; the file
``<out>.position.json`` beside the output holds the next offset per partition and is rewritten only
after the rows before it are flushed to the output, so a re-run appends exactly the rows not yet written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import KafkaConfig
from engine.schemas import Experience
from streams.kafka import Consumer


class ExportError(RuntimeError):
    """The output cannot be written; the message says which path and why. Rows before it are kept."""


@dataclasses.dataclass(frozen=True, slots=True)
class ExportFilter:
    """Which experience records to keep (None: no bound)."""

    domains: frozenset[str] = frozenset()
    min_reward: float | None = None
    max_reward: float | None = None
    min_version: int | None = None
    max_version: int | None = None
    since_ms: int | None = None
    until_ms: int | None = None

    def keep(self, exp: Experience, timestamp_ms: int) -> bool:
        version = exp.min_version()
        return ((not self.domains or exp.domain in self.domains)
                and (self.min_reward is None or exp.reward >= self.min_reward)
                and (self.max_reward is None or exp.reward <= self.max_reward)
                and (self.min_version is None or version >= self.min_version)
                and (self.max_version is None or version <= self.max_version)
                and (self.since_ms is None or timestamp_ms >= self.since_ms)
                and (self.until_ms is None or timestamp_ms <= self.until_ms))


def experience_row(exp: Experience, *, trace: str | None, timestamp_ms: int) -> dict[str, Any]:
    """An experience record as a flat JSON-able row (arrays as lists); what ``datasets`` loads."""
    row: dict[str, Any] = {}
    for f in dataclasses.fields(exp):
        value = getattr(exp, f.name)
        row[f.name] = value.tolist() if isinstance(value, np.ndarray) else value
    row["facts"] = json.dumps(exp.facts, sort_keys=True, default=str)  # free-form: one string column
    row["trace_parent"] = trace or ""
    row["timestamp_ms"] = timestamp_ms
    return row


def position_path(out: Path) -> Path:
    return out.with_name(out.name + ".position.json")


def _write_position(out: Path, offsets: dict[tuple[str, int], int]) -> None:
    path = position_path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({f"{t}:{p}": o for (t, p), o in sorted(offsets.items())}))
    os.replace(tmp, path)


def read_position(out: Path) -> dict[tuple[str, int], int]:
    path = position_path(out)
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])): int(v) for k, v in raw.items()}


def _write_parquet_part(out: Path, rows: list[dict[str, Any]]) -> None:
    """One Parquet part file per batch in the directory ``out`` (``load_dataset("parquet", data_files=out/*)``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob("part-*.parquet")))
    tmp = out / f".part-{n:06d}.parquet.tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, out / f"part-{n:06d}.parquet")


async def export_parquet(cfg: KafkaConfig, topic: str, out: Path, flt: ExportFilter, *,
                         idle_s: float = 3.0) -> tuple[int, int]:
    """Like :func:`export_jsonl`, into the directory ``out`` as Parquet part files (one per batch read)."""
    start = read_position(out)
    offsets = dict(start)
    read = written = 0
    consumer = Consumer(cfg, assign_topics=[topic], start_offsets=start or None, expect=(Experience.SCHEMA,))
    async with consumer:
        while records := await consumer.getmany(timeout_s=idle_s):
            rows = []
            for rec in records:
                read += 1
                offsets[(rec.topic, rec.partition)] = rec.offset + 1
                if isinstance(rec.message, Experience) and flt.keep(rec.message, rec.timestamp_ms):
                    rows.append(experience_row(rec.message, trace=rec.traceparent, timestamp_ms=rec.timestamp_ms))
            if rows:
                try:
                    _write_parquet_part(out, rows)
                except OSError as exc:
                    raise ExportError(f"{out}: write failed after {written} rows this run "
                                      f"({exc.strerror or exc}); earlier part files are kept") from None
            written += len(rows)
            _write_position(out, offsets)
    return read, written


async def export_jsonl(cfg: KafkaConfig, topic: str, out: Path, flt: ExportFilter, *,
                       idle_s: float = 3.0) -> tuple[int, int]:
    """Append the records of ``topic`` after the stored position to ``out``; returns (read, written).

    Stops once no record has arrived for ``idle_s`` (the log is read to its current end).
    """
    start = read_position(out)
    offsets = dict(start)
    read = written = 0
    try:
        f = out.open("a", encoding="utf-8")
    except OSError as exc:
        raise ExportError(f"{out}: cannot open for writing: {exc.strerror or exc}") from None
    consumer = Consumer(cfg, assign_topics=[topic], start_offsets=start or None, expect=(Experience.SCHEMA,))
    async with consumer:
        with f:
            while True:
                records = await consumer.getmany(timeout_s=idle_s)
                if not records:
                    break
                lines = []
                for rec in records:
                    read += 1
                    offsets[(rec.topic, rec.partition)] = rec.offset + 1
                    exp = rec.message
                    if isinstance(exp, Experience) and flt.keep(exp, rec.timestamp_ms):
                        lines.append(json.dumps(experience_row(exp, trace=rec.traceparent,
                                                               timestamp_ms=rec.timestamp_ms)) + "\n")
                try:
                    f.write("".join(lines))
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as exc:
                    raise ExportError(f"{out}: write failed after {written} rows this run ({exc.strerror or exc}); "
                                      f"rows before are kept and {position_path(out).name} marks where to resume") from None
                written += len(lines)
                _write_position(out, offsets)
    return read, written
