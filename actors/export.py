"""Export trajectories from the ``rollout.experience`` log to JSONL, filtered and resumable.

Two views: the full record (:func:`experience_row`: token ids, logprobs, versions, rewards, facts) and,
with an :class:`SftView`, the chat messages of the successful trajectories only (``{"messages": [...]}``,
the conversational format of SFT trainers), decoded from the token ids with the model's tokenizer.

Why a position file: an export of a long run is interrupted (disk full, ^C) and re-run; the file
``<out>.position.json`` beside the output holds the next offset per partition and is rewritten only
after the rows before it are flushed to the output, so a re-run appends exactly the rows not yet written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import KafkaConfig
from engine.schemas import Experience
from streams.protocols import AssignedConsumer, EventLog
from streams.transports import KafkaEventLog


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


_CHATML_TURN = re.compile(r"<\|im_start\|>([A-Za-z_]+)\n(.*?)(?:<\|im_end\|>|$)", re.S)


def correctness(exp: Experience) -> float:
    """The verifier's correctness of a sample (``facts.reward_terms.correctness``; the reward when absent)."""
    terms = exp.facts.get("reward_terms") if isinstance(exp.facts, dict) else None
    if isinstance(terms, dict) and "correctness" in terms:
        return float(terms["correctness"])
    return float(exp.reward)


@dataclasses.dataclass(frozen=True)
class SftView:
    """The SFT view: chat messages of the trajectories that succeeded.

    Success: ``reward >= min_reward`` when given, else fully solved (correctness 1). Messages come from the
    token ids: a ChatML-rendered sequence (``<|im_start|>role ... <|im_end|>``: SmolLM2, Qwen) is split
    into its turns as rendered (system, user, assistant, and the observation turns the episode added);
    a sequence without a chat template (raw text) becomes one user turn (the prompt), then the response's
    runs: model tokens (loss mask 1) as ``assistant`` turns, observations (loss mask 0) as ``tool`` turns.
    """

    tokenizer: Any
    min_reward: float | None = None

    def successful(self, exp: Experience) -> bool:
        if exp.filtered == "verifier_error" or exp.facts.get("verifier_error"):
            return False
        return exp.reward >= self.min_reward if self.min_reward is not None else correctness(exp) >= 1.0

    def messages(self, exp: Experience) -> list[dict[str, str]]:
        full = [int(t) for t in exp.prompt_ids] + [int(t) for t in exp.response_ids]
        text = self.tokenizer.decode(full, skip_special_tokens=False)
        turns = _CHATML_TURN.findall(text)
        if turns:
            return [{"role": role, "content": content.strip()} for role, content in turns
                    if content.strip() or role == "assistant"]
        prompt = self.tokenizer.decode([int(t) for t in exp.prompt_ids], skip_special_tokens=True)
        out = [{"role": "user", "content": prompt.strip()}]
        mask = exp.loss_mask.astype(bool)
        start = 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                content = self.tokenizer.decode([int(t) for t in exp.response_ids[start:i]], skip_special_tokens=True)
                out.append({"role": "assistant" if mask[start] else "tool", "content": content.strip()})
                start = i
        return out

    def row(self, exp: Experience) -> dict[str, Any] | None:
        return {"messages": self.messages(exp)} if self.successful(exp) else None


def _row_for(sft: SftView | None) -> Callable[[Experience, Any], dict[str, Any] | None]:
    if sft is not None:
        return lambda exp, rec: sft.row(exp)
    return lambda exp, rec: experience_row(exp, trace=rec.traceparent, timestamp_ms=rec.timestamp_ms)


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


def _reader(source: EventLog | KafkaConfig, topic: str, start: dict[tuple[str, int], int]) -> AssignedConsumer:
    """Every partition of ``topic`` from the stored position (the beginning where it has none)."""
    log = KafkaEventLog(source) if isinstance(source, KafkaConfig) else source
    return log.assigned_consumer(topics=[topic], start_offsets=start, expect=(Experience.SCHEMA,),
                                 client_id="rollout-export")


async def _copy_rows(source: EventLog | KafkaConfig, topic: str, out: Path, start: dict[tuple[str, int], int],
                     flt: ExportFilter, make_row: Callable[[Experience, Any], dict[str, Any] | None], idle_s: float,
                     write: Callable[[list[dict[str, Any]], int], None]) -> tuple[int, int]:
    """Read ``topic`` from ``start`` until no record arrives for ``idle_s``; each batch's kept rows go to
    ``write(rows, rows written before them this run)``, then the position after the batch is stored.
    Returns (read, written)."""
    offsets = dict(start)
    read = written = 0
    consumer = await _reader(source, topic, start).start()
    try:
        while records := await consumer.getmany(timeout_s=idle_s):
            rows = []
            for rec in records:
                read += 1
                offsets[(rec.topic, rec.partition)] = rec.offset + 1
                exp = rec.message
                if isinstance(exp, Experience) and flt.keep(exp, rec.timestamp_ms):
                    row = make_row(exp, rec)
                    if row is not None:
                        rows.append(row)
            write(rows, written)
            written += len(rows)
            _write_position(out, offsets)
    finally:
        await consumer.close()
    return read, written


async def export_parquet(source: EventLog | KafkaConfig, topic: str, out: Path, flt: ExportFilter, *,
                         idle_s: float = 3.0, sft: SftView | None = None) -> tuple[int, int]:
    """Like :func:`export_jsonl`, into the directory ``out`` as Parquet part files (one per batch read)."""

    def write(rows: list[dict[str, Any]], written: int) -> None:
        if rows:
            try:
                _write_parquet_part(out, rows)
            except OSError as exc:
                raise ExportError(f"{out}: write failed after {written} rows this run "
                                  f"({exc.strerror or exc}); earlier part files are kept") from None

    return await _copy_rows(source, topic, out, read_position(out), flt, _row_for(sft), idle_s, write)


async def export_jsonl(source: EventLog | KafkaConfig, topic: str, out: Path, flt: ExportFilter, *,
                       idle_s: float = 3.0, sft: SftView | None = None) -> tuple[int, int]:
    """Append the records of ``topic`` after the stored position to ``out``; returns (read, written).

    ``source`` is the event log to read (a ``KafkaConfig`` means that cluster's).

    Stops once no record has arrived for ``idle_s`` (the log is read to its current end). With ``sft``,
    rows are the SFT view of the successful records (see :class:`SftView`).
    """
    make_row = _row_for(sft)
    start = read_position(out)
    try:
        f = out.open("a", encoding="utf-8")
    except OSError as exc:
        raise ExportError(f"{out}: cannot open for writing: {exc.strerror or exc}") from None

    def write(rows: list[dict[str, Any]], written: int) -> None:
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        try:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            raise ExportError(f"{out}: write failed after {written} rows this run ({exc.strerror or exc}); "
                              f"rows before are kept and {position_path(out).name} marks where to resume") from None

    with f:
        return await _copy_rows(source, topic, out, start, flt, make_row, idle_s, write)
