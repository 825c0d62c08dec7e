"""The eval actor's pure parts: which versions it evaluates, its config's errors, its message on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.eval_role import due, eval_tasks, result_message
from actors.evaluate import EpisodeRecord, summarise
from engine.config import EngineConfig, EvalConfig
from engine.schemas import EvalResult, SchemaError
from streams.codec import decode, encode


@pytest.mark.parametrize(("version", "last", "every", "expected"), [
    (0, None, 5, True),    # the first version served is always evaluated (the baseline)
    (3, 0, 5, False),
    (5, 0, 5, True),
    (7, 0, 5, True),       # versions skipped while an evaluation ran: the next one past the mark
    (9, 7, 5, False),
    (12, 7, 5, True),
    (1, 0, 1, True),
    (0, 0, 1, False),      # never the same version twice
])
def test_due(version: int, last: int | None, every: int, expected: bool) -> None:
    assert due(version, last, every) is expected


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="eval.every_versions is set but"):
        EvalConfig(every_versions=2)
    with pytest.raises(ValidationError, match="eval.samples = 4 needs eval.temperature > 0"):
        EvalConfig(every_versions=2, domains={"math": 8}, samples=4, temperature=0.0)
    with pytest.raises(ValidationError, match="eval.domains.math = 0"):
        EvalConfig(every_versions=2, domains={"math": 0})
    assert EngineConfig().eval.every_versions == 0  # off unless configured


def test_tasks_are_heldout_and_file_rows(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"id": "a", "domain": "math", "prompt": "1+1=", "answer": "2"}) + "\n")
    tasks = eval_tasks(EvalConfig(every_versions=1, domains={"math": 3}, task_file=str(f)))
    assert [t.domain for t in tasks] == ["math"] * 4
    assert tasks[-1].id == "a" and tasks[-1].spec["answer"] == "2"
    assert len({t.prompt for t in tasks[:3]}) == 3


def test_result_round_trips_through_the_codec() -> None:
    records = [EpisodeRecord("t1", "math", 0, 1.0, 1, 3), EpisodeRecord("t1", "math", 1, 0.0, 1, 5),
               EpisodeRecord("t2", "math", 0, 0.0, 1, 4), EpisodeRecord("t2", "math", 1, 0.0, 1, 2)]
    report = summarise(records, 2)["math"]
    msg = result_message(report, 7, 1.0, 2.5, "host-1")
    raw, _ = encode(msg, producer="test")
    back = decode(raw, expect=(EvalResult.SCHEMA,)).message
    assert isinstance(back, EvalResult)
    assert (back.weight_version, back.tasks, back.samples, back.completion_rate) == (7, 2, 2, 0.25)
    assert back.pass_at_k == pytest.approx(0.5) and back.completion_ci95[0] < 0.25 < back.completion_ci95[1]


def test_result_rejects_rates_outside_unit_interval() -> None:
    with pytest.raises(SchemaError, match="completion_rate"):
        EvalResult(domain="math", weight_version=1, tasks=1, samples=1, completion_rate=1.5, completion_ci95=[0, 1],
                   mean_correctness=0.0, pass_at_1=0.0, pass_at_k=0.0, mean_turns=1, mean_tokens=1,
                   temperature=1.0, elapsed_s=0.1).validate()
