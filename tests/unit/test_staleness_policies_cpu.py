"""The CPU run of the staleness policies (``loadtests/async_vs_sync.py --policies``): what it reads from a
run (the learner's audit log, the experiences' lengths) and the figures it makes of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.async_vs_sync import RunResult, audit_verdicts, policy_row


def _audit(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_audit_log_gives_each_sample_its_verdict_in_the_lineage(tmp_path: Path) -> None:
    path = _audit(tmp_path / "audit.jsonl", [
        {"event": "start", "life": "l0", "step": 0},
        {"life": "l0", "step": 1, "version": 0, "sample_id": "a/0", "verdict": "dropped_stale"},
        {"life": "l0", "step": 1, "version": 0, "sample_id": "b/0", "verdict": "filtered"},
        {"event": "step", "life": "l0", "step": 1, "version": 0, "samples": 2, "duplicates": 0},
        {"life": "l0", "step": 2, "version": 1, "sample_id": "c/0", "verdict": "train"},  # no marker: torn
        {"event": "start", "life": "l1", "step": 0},  # killed before checkpointing step 1: it is redone
        {"life": "l1", "step": 1, "version": 0, "sample_id": "a/0", "verdict": "train"},
        {"event": "step", "life": "l1", "step": 1, "version": 0, "samples": 1, "duplicates": 0}])
    assert audit_verdicts(path) == {"a/0": "train"}
    assert audit_verdicts(tmp_path / "missing.jsonl") == {}


def _run(lengths: dict[str, int], verdicts: dict[str, str]) -> RunResult:
    return RunResult("drop", seconds=10.0, steps=2, samples=len(lengths), cpu_busy=0.5, curve=[],
                     lengths=lengths, verdicts=verdicts)


def test_dropping_the_long_stale_samples_shows_as_a_length_shift_and_training_all_shows_none() -> None:
    lengths = {f"s{i}": i for i in range(1, 401)}
    # the 100 longest finished last and were dropped as stale; one filtered sample stays out of both sides
    dropped = {f"s{i}": ("dropped_stale" if i > 300 else "train") for i in range(1, 401)}
    dropped["s1"] = "filtered"
    row = policy_row(_run(lengths, dropped))
    assert (row["judged"], row["trained"], row["dropped_stale"], row["filtered"]) == (399, 299, 100, 1)
    assert row["length_ks"] == pytest.approx(100 / 399, abs=1e-4)  # sup |F_judged - F_trained| at length 300
    assert row["length_ks"] > row["length_ks_critical"]  # beyond chance at these sizes
    assert row["trained_samples_per_s"] == pytest.approx(29.9)
    kept = policy_row(_run(lengths, {s: "train" for s in lengths}))
    assert kept["length_ks"] == 0 and kept["dropped_stale"] == 0


def test_a_run_with_nothing_trained_is_an_error_naming_the_policy() -> None:
    with pytest.raises(RuntimeError, match="drop: the learner judged 1 and trained 0"):
        policy_row(_run({"a": 3, "b": 4}, {"a": "dropped_stale", "c": "train"}))
