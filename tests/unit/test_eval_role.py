"""The eval actor's pure parts: which versions it evaluates, its config's errors, its message on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.eval_role import RegressionWatch, due, eval_tasks, result_message
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
    # nothing to evaluate: no eval.domains, no task file, and a scheduler that trains no domain
    with pytest.raises(ValidationError, match="eval.every_versions is set but"):
        EngineConfig(eval=EvalConfig(every_versions=2), scheduler={"domains": {}, "published_tasks": True})
    assert EngineConfig(eval=EvalConfig(every_versions=2)).trained_domains() == ["arith"]  # every trained domain
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


def test_an_empty_domains_table_evaluates_every_trained_domain() -> None:
    cfg = EngineConfig(scheduler={"domains": {"arith": 1.0, "math": 2.0, "code": 0.0}},
                       eval=EvalConfig(every_versions=1, tasks_per_domain=5))
    tasks = eval_tasks(cfg.eval, cfg.trained_domains())
    assert sorted({t.domain for t in tasks}) == ["arith", "math"]  # a zero weight is not trained
    assert all(sum(t.domain == d for t in tasks) == 5 for d in ("arith", "math"))
    # named domains win over the trained ones
    assert {t.domain for t in eval_tasks(EvalConfig(every_versions=1, domains={"code": 2}), ["arith"])} == {"code"}
    with pytest.raises(ValueError, match="every trained domain.*'nope'"):
        eval_tasks(cfg.eval, ["nope"])
    with pytest.raises(ValueError, match="eval.domains: domain 'nope'"):
        eval_tasks(EvalConfig(every_versions=1, domains={"nope": 2}))


def test_a_regression_from_the_best_is_flagged_once_and_cleared_on_recovery() -> None:
    w = RegressionWatch(threshold=0.1)
    assert not w.observe("math", 0, 0.30)
    assert not w.observe("math", 5, 0.50)
    assert not w.observe("math", 10, 0.41)  # 0.09 below its best: noise
    assert w.observe("math", 15, 0.35) and w.regressed("math") and w.alerts == 1
    assert w.observe("math", 20, 0.30) and w.alerts == 1  # still the same regression
    assert not w.observe("arith", 20, 0.9)  # other domains are judged on their own best
    status = json.loads(json.dumps(w.status()))
    assert status["domains"]["math"] == {"accuracy": 0.30, "version": 20, "best": 0.50, "best_version": 5,
                                         "regressed": True}
    again = RegressionWatch(threshold=0.1)
    again.restore(status)  # a restarted eval actor keeps the run's bests
    assert again.regressed("math") and again.best["math"] == (0.5, 5)
    assert not again.observe("math", 25, 0.45) and not again.regressed("math")  # recovered
    assert again.observe("math", 30, 0.2) and again.alerts == 2
