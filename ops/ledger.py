"""The accounting ledger of a run: where every admitted sample went, rebuilt from the topics.

``build_ledger(cfg)`` reads a namespace's topics from the beginning (``tasks``, ``completions``,
``outcomes``, ``experience``, ``dlq``) plus the learner's checkpoint directory (the newest checkpoint's
``state.json`` and the audit log ``audit.jsonl`` written by ``actors/learner.py``) and proves:

- every admitted task produced its group's samples: sample ids are ``<task_id>/<index>`` for index in
  ``0..group_size-1``; each is looked for on ``completions``, ``outcomes`` and ``experience``;
- every sample reached the learner exactly once: it is in the final model's lineage once (trained,
  dropped as stale or filtered, the reason taken from its experience record), or it is still pending at
  the learner (its experience records all lie at or beyond the checkpoint's offsets: the next life
  reads them), never trained twice;
- duplicates on the topics (at-least-once re-deliveries) are de-duplicated by sample id and counted.

The lineage. Each learner life appends a ``start`` line (the step it resumed at) and, per step, one
line per folded sample then a ``step`` marker, all before that step's checkpoint. A life killed after
its last checkpoint leaves steps the next life redoes: a ``start`` at step ``s`` discards every line of
a step ``> s`` read so far. A step counts only with its marker (a line torn by a kill is ignored).
What remains is the final model's lineage, and its counts must equal the newest checkpoint's ledger.

``samples_lost`` counts admitted samples that are neither in the lineage nor pending at the learner:
``missing_experience`` (never reached ``rollout.experience``) plus ``lost_at_learner`` (an experience
record the learner read past without accounting for it). ``python -m ops.ledger --config F`` prints
the table; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, load_config
from engine.topics import Names

AUDIT_LOG = "audit.jsonl"  # actors.learner.AUDIT_LOG; not imported, so reading a ledger needs no torch


# -- the learner's lineage -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class AuditRow:
    step: int
    version: int
    sample_id: str
    verdict: str
    life: str


@dataclasses.dataclass(slots=True)
class Lineage:
    """The samples folded into the final model, step by step, and how many lives it took."""

    rows: list[AuditRow] = dataclasses.field(default_factory=list)
    lives: int = 0
    superseded_rows: int = 0
    """Rows of steps a killed life made after its last checkpoint (redone by the next life)."""
    torn_rows: int = 0
    """Rows without their step marker (a kill while the step was being written)."""

    @property
    def last_step(self) -> int:
        return max((r.step for r in self.rows), default=0)


def read_lineage(lines: Iterable[str]) -> Lineage:
    """Rebuild the final lineage from the audit log's lines (see the module docstring)."""
    kept: dict[int, list[AuditRow]] = {}
    open_rows: list[AuditRow] = []  # rows of the step being read, not yet confirmed by its marker
    out = Lineage()
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line torn by SIGKILL: its step has no marker either
        if not isinstance(row, dict):
            continue
        event = row.get("event")
        if event == "start":
            out.torn_rows += len(open_rows)
            open_rows = []
            resumed = int(row.get("step", 0))
            for step in [s for s in kept if s > resumed]:
                out.superseded_rows += len(kept.pop(step))
            out.lives += 1
        elif event == "step":
            step = int(row["step"])
            rows = [r for r in open_rows if r.step == step and r.life == row.get("life")]
            out.torn_rows += len(open_rows) - len(rows)
            open_rows = []
            if step in kept:  # cannot happen without a start line in between; keep the newest
                out.superseded_rows += len(kept[step])
            kept[step] = rows
        elif "sample_id" in row:
            open_rows.append(AuditRow(int(row["step"]), int(row["version"]), str(row["sample_id"]),
                                      str(row["verdict"]), str(row.get("life", ""))))
    out.torn_rows += len(open_rows)
    out.rows = [r for step in sorted(kept) for r in kept[step]]
    return out


def read_audit(path: Path) -> Lineage:
    if not path.is_file():
        return Lineage()
    with path.open() as f:
        return read_lineage(f)


def latest_checkpoint_state(root: Path) -> tuple[Path | None, dict[str, Any]]:
    """(path, state.json) of the newest complete checkpoint under ``root``; (None, {}) if none."""
    from actors.learner_checkpoint import CheckpointStore  # torch only when a checkpoint exists

    if not root.is_dir():
        return None, {}
    latest = CheckpointStore(root).latest()
    if latest is None:
        return None, {}
    return latest, json.loads((latest / "state.json").read_text())


# -- the topics ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class TopicRecord:
    partition: int
    offset: int
    message_id: str
    message: Any
    producer: str = ""
    """The envelope's producer id (``<namespace>/<host>-<pid>``: a restarted process is another producer)."""


def read_topic(cfg: EngineConfig, topic: str, *, timeout_s: float = 60.0) -> Iterator[TopicRecord | tuple[int, int, str]]:
    """Every record of ``topic`` from the beginning up to its end offsets at call time.

    Yields ``TopicRecord``, or ``(partition, offset, reason)`` for a record that does not decode.
    """
    from streams.codec import DecodeError
    from streams.kafka import read_range

    for partition, offset, env in read_range(cfg.kafka, topic, timeout_s=timeout_s, client_id="rollout-ledger"):
        if isinstance(env, DecodeError):
            yield (partition, offset, env.reason)
        else:
            yield TopicRecord(partition, offset, env.id, env.message, env.producer)


# -- the ledger ------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class Stage:
    """One topic's view: records, distinct sample ids, duplicate records (re-deliveries)."""

    records: int = 0
    undecodable: int = 0
    ids: set[str] = dataclasses.field(default_factory=set)

    @property
    def duplicates(self) -> int:
        return self.records - len(self.ids)

    def add(self, sample_id: str) -> None:
        self.records += 1
        self.ids.add(sample_id)


@dataclasses.dataclass(slots=True)
class LedgerReport:
    namespace: str
    tasks: Stage
    group_sizes: dict[str, int]
    completions: Stage
    outcomes: Stage
    experience: Stage
    dlq: dict[str, int]
    """``<original topic suffix>:<reason>`` -> dead letters."""
    filter_reasons: dict[str, str]
    """sample_id -> its experience's ``filtered`` reason ('' when trainable)."""
    sandbox_errors: int
    """Samples whose completion finished with ``sandbox_error`` (their episode lost its sandbox)."""
    lineage: Lineage
    checkpoint: str | None
    checkpoint_state: dict[str, Any]
    pending_at_learner: set[str]
    lost_at_learner: set[str]
    verdicts: dict[str, collections.Counter]
    """sample_id -> Counter of its verdicts in the lineage."""

    # -- the figures -----------------------------------------------------------------------------
    @property
    def expected(self) -> set[str]:
        return {f"{t}/{i}" for t, n in self.group_sizes.items() for i in range(n)}

    @property
    def missing_completion(self) -> set[str]:
        return self.expected - self.completions.ids

    @property
    def missing_experience(self) -> set[str]:
        return self.expected - self.experience.ids

    @property
    def unexpected(self) -> set[str]:
        """Experience of samples no task on ``rollout.tasks`` asked for."""
        return self.experience.ids - self.expected

    @property
    def trained_twice(self) -> set[str]:
        return {s for s, c in self.verdicts.items() if c["train"] > 1}

    @property
    def accounted_twice(self) -> set[str]:
        """In the lineage more than once (allowed only as a re-counted stale drop, never trained twice)."""
        return {s for s, c in self.verdicts.items() if sum(c.values()) > 1}

    @property
    def samples_lost(self) -> int:
        return len(self.missing_experience) + len(self.lost_at_learner)

    def lineage_counts(self) -> dict[str, int]:
        counts = collections.Counter(r.verdict for r in self.lineage.rows)
        return {"trained": counts["train"], "dropped_stale": counts["dropped_stale"], "filtered": counts["filtered"]}

    def fates(self) -> dict[str, int]:
        """Each expected sample's fate, counted once (first verdict in the lineage wins)."""
        out: collections.Counter[str] = collections.Counter()
        for sid in self.expected:
            c = self.verdicts.get(sid)
            if c:
                verdict = "trained" if c["train"] else ("dropped_stale" if c["dropped_stale"] else "filtered")
                if verdict == "filtered":
                    verdict = f"filtered:{self.filter_reasons.get(sid) or '?'}"
                out[verdict] += 1
            elif sid in self.pending_at_learner:
                out["pending_at_learner"] += 1
            elif sid in self.lost_at_learner:
                out["lost_at_learner"] += 1
            elif sid not in self.completions.ids:
                out["missing:no_completion"] += 1
            elif sid not in self.outcomes.ids:
                out["missing:no_outcome"] += 1
            else:
                out["missing:no_experience"] += 1
        return dict(sorted(out.items()))

    def checkpoint_agrees(self) -> bool:
        """The lineage's counts equal the newest checkpoint's ledger (and its step)."""
        if not self.checkpoint_state:
            return not self.lineage.rows
        ledger = self.checkpoint_state.get("ledger", {})
        counts = self.lineage_counts()
        return (self.lineage.last_step == int(self.checkpoint_state.get("step", 0))
                and all(int(ledger.get(k, 0)) == v for k, v in counts.items()))

    def summary(self) -> dict[str, Any]:
        counts = self.lineage_counts()
        return {
            "namespace": self.namespace,
            "tasks_admitted": len(self.group_sizes),
            "task_duplicates": self.tasks.duplicates,
            "samples_expected": len(self.expected),
            "completions_distinct": len(self.completions.ids & self.expected),
            "completion_duplicates": self.completions.duplicates,
            "outcomes_distinct": len(self.outcomes.ids & self.expected),
            "outcome_duplicates": self.outcomes.duplicates,
            "experience_distinct": len(self.experience.ids & self.expected),
            "experience_duplicates": self.experience.duplicates,
            "experience_unexpected": len(self.unexpected),
            "dlq": sum(self.dlq.values()),
            "sandbox_errors": self.sandbox_errors,
            "learner_lives": self.lineage.lives,
            "learner_steps": self.lineage.last_step,
            "lineage_superseded_rows": self.lineage.superseded_rows,
            "learner_trained": counts["trained"],
            "learner_dropped_stale": counts["dropped_stale"],
            "learner_filtered": counts["filtered"],
            "pending_at_learner": len(self.pending_at_learner),
            "missing_completion": len(self.missing_completion),
            "missing_experience": len(self.missing_experience),
            "lost_at_learner": len(self.lost_at_learner),
            "samples_lost": self.samples_lost,
            "samples_trained_twice": len(self.trained_twice),
            "samples_accounted_twice": len(self.accounted_twice),
            "checkpoint_agrees": self.checkpoint_agrees(),
            "fates": self.fates(),
        }

    def table(self) -> str:
        s = self.summary()
        exp = s["samples_expected"]
        rows = [
            ("tasks admitted (distinct task ids)", s["tasks_admitted"], f"{s['task_duplicates']} duplicate records"),
            ("samples expected (tasks x group)", exp, ""),
            ("completions (distinct sample ids)", s["completions_distinct"],
             f"{s['completion_duplicates']} duplicate records; {s['missing_completion']} missing"),
            ("outcomes (distinct)", s["outcomes_distinct"], f"{s['outcome_duplicates']} duplicate records"),
            ("experience (distinct)", s["experience_distinct"],
             f"{s['experience_duplicates']} duplicate records; {s['missing_experience']} missing"),
            ("  of which sandbox_error episodes", s["sandbox_errors"], ""),
            ("dead letters", s["dlq"], ", ".join(f"{k}={v}" for k, v in sorted(self.dlq.items()))),
            ("learner lives / steps in lineage", f"{s['learner_lives']} / {s['learner_steps']}",
             f"{s['lineage_superseded_rows']} audit rows superseded (redone after a kill)"),
            ("  trained", s["learner_trained"], ""),
            ("  dropped stale", s["learner_dropped_stale"], ""),
            ("  filtered", s["learner_filtered"], ""),
            ("  pending at the learner (next life)", s["pending_at_learner"], "beyond the checkpoint's offsets"),
            ("lost (no experience, or skipped by the learner)", s["samples_lost"],
             f"{s['lost_at_learner']} skipped by the learner"),
            ("trained twice", s["samples_trained_twice"], ""),
            ("accounted twice (re-counted stale)", s["samples_accounted_twice"], ""),
            ("lineage == checkpoint ledger", s["checkpoint_agrees"], self.checkpoint or "no checkpoint"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"ledger of namespace {self.namespace}", "-" * (width + 40)]
        lines += [f"{name:<{width}}  {str(value):>10}  {note}" for name, value, note in rows]
        lines.append("fates: " + ", ".join(f"{k}={v}" for k, v in s["fates"].items()))
        return "\n".join(lines)


def build_ledger(cfg: EngineConfig, checkpoint_root: str | Path | None = None, *,
                 timeout_s: float = 120.0) -> LedgerReport:
    """Read the namespace's topics and the learner's checkpoint directory; see the module docstring."""
    from engine.schemas import SANDBOX_ERROR, Completion, DeadLetter, Experience, Outcome, Task

    names = Names(cfg.namespace)
    root = Path(checkpoint_root) if checkpoint_root is not None else Path(cfg.learner.checkpoint_dir) / cfg.namespace

    tasks, group_sizes = Stage(), {}
    for rec in read_topic(cfg, names.tasks, timeout_s=timeout_s):
        if isinstance(rec, tuple):
            tasks.undecodable += 1
        elif isinstance(rec.message, Task):
            tasks.add(rec.message.task_id)
            group_sizes[rec.message.task_id] = rec.message.group_size

    completions, sandbox_errors = Stage(), set()
    for rec in read_topic(cfg, names.completions, timeout_s=timeout_s):
        if isinstance(rec, tuple):
            completions.undecodable += 1
        elif isinstance(rec.message, Completion):
            completions.add(rec.message.sample_id)
            if rec.message.finish_reason == SANDBOX_ERROR:
                sandbox_errors.add(rec.message.sample_id)

    outcomes = Stage()
    for rec in read_topic(cfg, names.outcomes, timeout_s=timeout_s):
        if isinstance(rec, tuple):
            outcomes.undecodable += 1
        elif isinstance(rec.message, Outcome):
            outcomes.add(str(rec.message.completion.get("sample_id", "")))

    experience, reasons = Stage(), dict[str, str]()
    positions: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for rec in read_topic(cfg, names.experience, timeout_s=timeout_s):
        if isinstance(rec, tuple):
            experience.undecodable += 1
        elif isinstance(rec.message, Experience):
            sid = rec.message.sample_id
            experience.add(sid)
            reasons.setdefault(sid, rec.message.filtered)
            positions[sid].append((rec.partition, rec.offset))

    dlq: collections.Counter[str] = collections.Counter()
    for rec in read_topic(cfg, names.dlq, timeout_s=timeout_s):
        if isinstance(rec, tuple):
            dlq["?:undecodable"] += 1
        elif isinstance(rec.message, DeadLetter):
            suffix = rec.message.topic.removeprefix(f"{cfg.namespace}.rollout.")
            dlq[f"{suffix}:{rec.message.reason}"] += 1

    lineage = read_audit(root / AUDIT_LOG)
    ckpt, state = latest_checkpoint_state(root)
    offsets = {int(p): int(o) for t, p, o in state.get("offsets", []) if t == names.experience}
    verdicts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in lineage.rows:
        verdicts[row.sample_id][row.verdict] += 1
    pending, lost = set(), set()
    for sid, where in positions.items():
        if sid in verdicts:
            continue
        if all(off >= offsets.get(part, 0) for part, off in where):
            pending.add(sid)
        else:
            lost.add(sid)
    return LedgerReport(namespace=cfg.namespace, tasks=tasks, group_sizes=group_sizes, completions=completions,
                        outcomes=outcomes, experience=experience, dlq=dict(dlq), filter_reasons=reasons,
                        sandbox_errors=len(sandbox_errors), lineage=lineage,
                        checkpoint=str(ckpt) if ckpt else None, checkpoint_state=state,
                        pending_at_learner=pending, lost_at_learner=lost, verdicts=dict(verdicts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.ledger", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's TOML config (namespace, kafka, learner.checkpoint_dir)")
    parser.add_argument("--checkpoint-root", help="default: <learner.checkpoint_dir>/<namespace>")
    parser.add_argument("--json", help="write the summary as JSON here")
    args = parser.parse_args(argv)
    report = build_ledger(load_config(args.config), args.checkpoint_root)
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.summary(), indent=2))
    s = report.summary()
    return 0 if s["samples_lost"] == 0 and s["samples_trained_twice"] == 0 and s["checkpoint_agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
