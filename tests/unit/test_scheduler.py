"""Scheduler logic without infrastructure: admission rule, domain weights, curriculum, sources."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from domains import DOMAINS
from actors.scheduler import Admission, Curriculum, DomainMixer, GeneratorSource, LearnerStatus, TaskFileSource


def test_admission_rule() -> None:
    a = Admission(batch_size=8, max_staleness=1)
    v0 = LearnerStatus()
    assert a.capacity(0) == 16 and a.capacity(3) == 40
    assert a.can_admit(12, 4, v0)
    assert not a.can_admit(16, 4, v0)
    assert a.can_admit(16, 4, LearnerStatus(version=1))
    # samples the learner filtered out leave room, or a run of all-filtered groups would stall
    assert a.can_admit(16, 4, LearnerStatus(version=0, filtered=4))
    assert Admission(batch_size=4, max_staleness=0).can_admit(0, 4, v0)
    assert not Admission(batch_size=4, max_staleness=0).can_admit(4, 4, v0)
    # less than a group of room left still admits one: otherwise a learner a few samples short of a
    # batch (per-sample stale drops) and a scheduler waiting for a whole group of room wait forever
    assert a.can_admit(15, 4, v0) and not a.can_admit(16, 1, v0)


def test_admission_never_stalls_when_stale_drops_leave_a_partial_batch() -> None:
    """The sync deadlock found by loadtests/async_vs_sync.py: max_staleness 0, batch 32, groups of 8,
    7 steps trained, and the pending batch 5 samples short after per-sample stale drops."""
    a = Admission(batch_size=32, max_staleness=0)
    status = LearnerStatus(version=7, filtered=264)
    admitted = 7 * 32 + 27 + 264  # trained + trainable pending + excluded
    assert a.can_admit(admitted, 8, status)


def test_admission_simulated_run_never_exceeds_the_staleness_bound() -> None:
    batch, staleness, group = 8, 2, 4
    a = Admission(batch_size=batch, max_staleness=staleness)
    admitted = trained = 0
    for _ in range(200):
        status = LearnerStatus(version=trained // batch)
        while a.can_admit(admitted, group, status):
            admitted += group
        assert admitted - trained <= (staleness + 1) * batch + batch
        trained = min(admitted, trained + group)  # the learner trains what was admitted, slowly
    assert trained > 100


def test_learner_status_parsing() -> None:
    assert LearnerStatus.from_json(None) == LearnerStatus()
    s = LearnerStatus.from_json(json.dumps({"version": 3, "step": 7, "consumed": 90, "extra": "x"}).encode())
    assert (s.version, s.step, s.consumed, s.filtered) == (3, 7, 90, 0)


def test_mixer_weights_and_rebalance() -> None:
    m = DomainMixer({"arith": 3.0, "code": 1.0}, floor=0.1, min_groups=4)
    assert m.weights == {"arith": 0.75, "code": 0.25}
    m.rebalance("arith", {"groups": 2, "zero_variance_rate": 1.0})
    assert m.weights["arith"] == 0.75  # too few groups to judge
    m.rebalance("arith", {"groups": 10, "zero_variance_rate": 2 / 3})
    assert m.weights["arith"] == pytest.approx(0.5)
    m.rebalance("code", {"groups": 10, "zero_variance_rate": 1.0})
    assert m.weights["code"] == pytest.approx(0.1 / 1.1)  # floored, never starved
    rng = random.Random(0)
    picks = [m.pick(rng) for _ in range(2000)]
    assert 0.85 < picks.count("arith") / len(picks) < 0.95
    m.remove("arith")
    m.remove("code")
    assert m.pick(rng) is None
    with pytest.raises(ValueError):
        DomainMixer({"a": 0.0})


def test_curriculum_rises_with_success_and_falls_with_failure() -> None:
    c = Curriculum(step=0.25, raise_at=0.8, lower_at=0.2, min_samples=10)
    assert c.observe("arith", 0, 1.0) == 0.0
    assert c.observe("arith", 9, 1.0) == 0.0  # not enough new samples yet
    assert c.observe("arith", 10, 0.9) == 0.25
    assert c.observe("arith", 15, 0.9) == 0.25
    assert c.observe("arith", 20, 0.5) == 0.25  # in the comfortable band: stay
    assert c.observe("arith", 40, 0.95) == 0.5
    for n in range(50, 200, 10):
        c.observe("arith", n, 1.0)
    assert c.difficulty("arith") == 1.0
    assert c.observe("arith", 300, 0.1) == 0.75
    assert c.difficulty("code") == 0.0


def test_generator_source_is_seeded() -> None:
    a = GeneratorSource(DOMAINS["code"], seed=1)
    b = GeneratorSource(DOMAINS["code"], seed=1)
    ta, tb = a.next(0.0), b.next(0.0)
    assert ta == tb and ta.stop == ("\n",) and ta.max_turns == 1
    t = GeneratorSource(DOMAINS["terminal"]).next(1.0)
    assert t.max_turns == t.spec["max_turns"]


def test_a_task_file_source_issues_each_row_once_with_its_domains_settings(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    rows = [{"domain": "arith", "prompt": "1+1=", "answer": "2"},
            {"domain": "docqa", "prompt": "say x", "answer": "x", "max_turns": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    src = TaskFileSource(path)
    first, second = src.next(0.0), src.next(0.0)
    assert first is not None and (first.domain, first.prompt, first.stop) == ("arith", "1+1=", ("\n",))
    assert second is not None and (second.domain, second.max_turns, second.stop) == ("docqa", 2, DOMAINS["docqa"].stop)
    assert src.next(0.0) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"domain": "custom", "prompt": "say x", "answer": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: field 'domain': unknown domain 'custom'"):
        TaskFileSource(bad)
    bad.write_text(json.dumps({"domain": "arith"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: field 'prompt'"):
        TaskFileSource(bad)


def test_sampling_overrides_go_over_the_domains_budget_and_bad_ones_are_refused() -> None:
    from types import SimpleNamespace

    from pydantic import ValidationError

    from actors.scheduler import SchedulerActor
    from engine.config import EngineConfig, InferenceConfig, SamplingOverrides, SchedulerConfig

    def sampling(overrides: SamplingOverrides, budget: int | None) -> dict[str, object]:
        cfg = EngineConfig(inference=InferenceConfig(max_new_tokens=16, temperature=0.7),
                           scheduler=SchedulerConfig(sampling=overrides))
        actor = SimpleNamespace(cfg=cfg.scheduler, rt=SimpleNamespace(cfg=cfg))
        return SchedulerActor._sampling(actor, budget, ["\n"])  # type: ignore[arg-type]

    # none: the domain's budget, else the inference default; no ignore_eos
    assert sampling(SamplingOverrides(), 8) == {"max_new_tokens": 8, "temperature": 0.7, "stop": ["\n"]}
    assert sampling(SamplingOverrides(), None)["max_new_tokens"] == 16
    # fixed-length generations (chaos --long): every task's budget, generated to its end
    assert sampling(SamplingOverrides(ignore_eos=True, max_new_tokens=384), 8) == {
        "max_new_tokens": 384, "temperature": 0.7, "stop": ["\n"], "ignore_eos": True}
    # no stop strings: the generation runs to its budget
    assert "stop" not in sampling(SamplingOverrides(ignore_eos=True, stop=[]), 8)
    assert sampling(SamplingOverrides(stop=["###"]), 8)["stop"] == ["###"]
    with pytest.raises(ValidationError, match="max_new_tokens"):
        SamplingOverrides(max_new_tokens=0)
    with pytest.raises(ValidationError, match="top_q"):
        SchedulerConfig.model_validate({"sampling": {"top_q": 0.9}})
