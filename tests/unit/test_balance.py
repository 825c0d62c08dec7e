"""Dynamic domain balancing (actors/scheduler.py DomainMixer, RewardStatsMerger; scheduler.balance config)."""

from __future__ import annotations

import json
import random

import pytest

from actors.runtime import Runtime
from actors.scheduler import MIN_SIGNAL, DomainMixer, RewardStatsMerger, SchedulerActor
from engine.config import ConfigError, EngineConfig, SchedulerConfig, load_config
from streams.memory import MemoryEventLog, MemoryStore


def groups(n: int, *, varied: int, solve: float, group_size: int = 4) -> dict[str, float]:
    """Counter increments of ``n`` groups, ``varied`` of them with unequal rewards, mean correctness ``solve``."""
    return {"groups": n, "zero_variance_groups": n - varied, "count": n * group_size,
            "correct_total": solve * n * group_size, "verifier_errors": 0}


def signal_mixer(weights: dict[str, float], **kw) -> DomainMixer:
    return DomainMixer(weights, policy="signal", window=kw.pop("window", 32), min_groups=4, **kw)


def test_a_domain_whose_groups_all_tie_loses_share() -> None:
    m = signal_mixer({"a": 1.0, "b": 1.0})
    assert m.weights == {"a": 0.5, "b": 0.5}  # unmeasured: configured weights
    for _ in range(8):
        m.observe("a", groups(4, varied=4, solve=0.5))
        m.observe("b", groups(4, varied=0, solve=1.0))  # every group all-correct: no signal
    w = m.weights
    assert w["b"] < 0.1 < 0.9 < w["a"]
    assert m.signal("b") == MIN_SIGNAL  # never starved: it keeps being measured
    # b's groups start to differ again: it regains share within one window
    for _ in range(8):
        m.observe("b", groups(4, varied=4, solve=0.5))
    assert m.weights["b"] == pytest.approx(0.5, abs=0.05)


def test_a_domain_that_stops_improving_loses_share() -> None:
    m = signal_mixer({"rising": 1.0, "flat": 1.0}, window=32)
    for step in range(8):  # rising: solve rate 0.2 -> 0.55; flat: 0.4 throughout; both with varied groups
        m.observe("rising", groups(4, varied=4, solve=0.2 + 0.05 * step))
        m.observe("flat", groups(4, varied=4, solve=0.4))
    improving = m.weights["rising"]
    assert improving > 0.54  # progress 0.2 on top of a full signal of 1: 1.2 : 1
    for _ in range(8):  # rising plateaus at 0.55
        m.observe("rising", groups(4, varied=4, solve=0.55))
        m.observe("flat", groups(4, varied=4, solve=0.4))
    assert m.weights["rising"] == pytest.approx(0.5, abs=0.01)
    assert m.weights["rising"] < improving
    # a domain solved almost always gets little (the band), even with varied groups
    m.observe("flat", groups(32, varied=32, solve=0.99))
    assert m.band_factor(0.99) < 0.2 and m.weights["flat"] < m.weights["rising"]


def test_floor_and_cap_hold() -> None:
    m = signal_mixer({"a": 10.0, "b": 1.0, "c": 1.0, "d": 1.0}, share_floor=0.1, share_cap=0.5,
                     floors={"d": 0.2})
    w = m.weights
    assert w["a"] == pytest.approx(0.5) and w["d"] == pytest.approx(0.2)
    assert sum(w.values()) == pytest.approx(1.0)
    for _ in range(8):
        m.observe("b", groups(4, varied=0, solve=0.0))
        m.observe("c", groups(4, varied=0, solve=0.0))
    w = m.weights
    assert w["b"] == pytest.approx(0.1) and w["c"] == pytest.approx(0.1)  # floored
    assert w["a"] <= 0.5 + 1e-9 and w["d"] >= 0.2 - 1e-9 and sum(w.values()) == pytest.approx(1.0)
    rng = random.Random(0)
    picks = [m.pick(rng) for _ in range(4000)]
    assert 0.07 < picks.count("b") / len(picks) < 0.13


def test_static_and_zero_variance_policies() -> None:
    static = DomainMixer({"a": 3.0, "b": 1.0}, policy="static")
    static.observe("a", groups(40, varied=0, solve=1.0))
    static.rebalance("a", {"groups": 40, "zero_variance_rate": 1.0})
    assert static.weights == {"a": 0.75, "b": 0.25}
    zv = DomainMixer({"a": 3.0, "b": 1.0}, policy="zero_variance")
    zv.observe("a", groups(40, varied=0, solve=1.0))  # windows do not move zero_variance...
    assert zv.weights == {"a": 0.75, "b": 0.25}
    zv.rebalance("a", {"groups": 40, "zero_variance_rate": 1.0})  # ...its all-time rate does
    assert zv.weights["a"] == pytest.approx(0.3 / 1.3)
    with pytest.raises(ValueError, match="'x'.*non-negative"):
        DomainMixer({"x": -1.0, "y": 1.0})
    with pytest.raises(ValueError, match="all 0"):
        DomainMixer({"x": 0.0})
    with pytest.raises(ValueError, match="floor 0.6 of 'x' is above its cap 0.5"):
        DomainMixer({"x": 1.0, "y": 1.0}, floors={"x": 0.6}, share_cap=0.5)
    with pytest.raises(ValueError, match="'z', not a source"):
        DomainMixer({"x": 1.0}, caps={"z": 0.5})


def test_a_domain_whose_verifier_always_fails_is_paused_counted_and_probed() -> None:
    now = [1000.0]
    m = signal_mixer({"ok": 1.0, "broken": 1.0}, pause_after=16, pause_s=60.0, clock=lambda: now[0])
    # what the reward actors count for groups whose every sample failed in the verifier: errors, no groups
    errors = {"verifier_errors": 8, "groups": 0, "zero_variance_groups": 0, "count": 0, "correct_total": 0}
    m.observe("broken", errors)
    assert not m.paused("broken")
    m.observe("broken", errors)
    assert m.paused("broken") and m.weights == {"ok": 1.0, "broken": 0.0}
    view = m.view()["broken"]
    assert view["paused"] and view["pauses"] == 1 and view["verifier_errors"] == 16
    assert view["window_groups"] == 0  # errors never enter the signal (no solve rate of 0 from them)
    now[0] += 61  # the pause ends: a probe
    assert not m.paused("broken") and m.weights["broken"] > 0
    m.observe("broken", errors)  # still failing: paused again at once
    assert m.paused("broken") and m.view()["broken"]["pauses"] == 2
    now[0] += 61
    m.observe("broken", groups(4, varied=4, solve=0.5))  # judged samples: resumed
    assert not m.paused("broken") and m.view()["broken"]["pauses"] == 2
    # every source paused: sampling goes on (an empty mix would read as "every source exhausted")
    only = signal_mixer({"x": 1.0}, pause_after=4, clock=lambda: now[0])
    only.observe("x", {"verifier_errors": 4})
    assert only.paused("x") and only.weights == {"x": 1.0}


def test_a_regressed_domain_is_boosted_under_signal() -> None:
    m = signal_mixer({"a": 1.0, "b": 1.0}, regression_boost=2.0)
    for _ in range(4):
        m.observe("a", groups(4, varied=4, solve=0.5))
        m.observe("b", groups(4, varied=4, solve=0.5))
    assert m.weights["a"] == pytest.approx(0.5)
    m.set_regressed({"a", "unknown"})
    assert m.weights["a"] == pytest.approx(2 / 3) and m.view()["a"]["regressed"]
    m.set_regressed(set())
    assert m.weights["a"] == pytest.approx(0.5)
    zv = DomainMixer({"a": 1.0, "b": 1.0}, policy="zero_variance", regression_boost=2.0)
    zv.set_regressed({"a"})
    assert zv.weights["a"] == 0.5  # only signal is steered by evaluations


def test_mixer_state_round_trips() -> None:
    m = signal_mixer({"a": 1.0, "b": 2.0}, pause_after=4, clock=lambda: 50.0)
    for step in range(6):
        m.observe("a", groups(3, varied=2, solve=0.1 * step))
    m.observe("b", {"verifier_errors": 5})
    state = json.loads(json.dumps(m.state()))
    again = signal_mixer({"a": 1.0, "b": 2.0}, pause_after=4, clock=lambda: 50.0)
    again.restore(state)
    assert again.weights == m.weights and again.view() == m.view()
    assert again.paused("b")


def test_reward_stats_of_several_writers_add_up() -> None:
    merger = RewardStatsMerger()

    def snap(instance: str, epoch: str, count: int, groups_: int, zv: int, correct: float, success: float) -> dict:
        return {"instance": instance, "epoch": epoch, "domains": {"d": {
            "count": count, "groups": groups_, "zero_variance_groups": zv, "correct_total": correct,
            "success": success, "verifier_errors": 0}}}

    assert merger.add(snap("r1", "e1", 8, 2, 1, 4.0, 0.5))["d"]["groups"] == 2
    assert merger.add(snap("r2", "e1", 4, 1, 1, 0.0, 0.0))["d"]["count"] == 4
    delta = merger.add(snap("r1", "e1", 12, 3, 1, 6.0, 0.5))["d"]  # r1 again: only what it added
    assert (delta["count"], delta["groups"], delta["zero_variance_groups"], delta["correct_total"]) == (4, 1, 0, 2.0)
    assert merger.add(snap("r1", "e1", 12, 3, 1, 6.0, 0.5)) == {}  # the same snapshot again adds nothing
    total = merger.merged()["d"]
    assert (total["count"], total["groups"], total["zero_variance_groups"]) == (16, 4, 2)  # not the last writer's
    assert total["zero_variance_rate"] == 0.5 and total["success"] == pytest.approx(12 * 0.5 / 16)
    # r2 restarts (a new epoch): its counters start from zero; the old ones are kept as retired
    assert merger.add(snap("r2", "e2", 4, 1, 0, 4.0, 1.0))["d"]["count"] == 4
    assert merger.merged()["d"]["count"] == 20
    # a writer that states only the rate (an older reward actor, a hand-written snapshot)
    legacy = RewardStatsMerger()
    legacy.add({"domains": {"d": {"count": 40, "groups": 20, "zero_variance_rate": 1.0, "success": 0.0}}})
    assert legacy.merged()["d"]["zero_variance_rate"] == 1.0 and legacy.merged()["d"]["zero_variance_groups"] == 20
    restored = RewardStatsMerger()
    restored.restore(json.loads(json.dumps(merger.state())))
    assert restored.merged() == merger.merged()
    assert restored.add(snap("r1", "e1", 12, 3, 1, 6.0, 0.5)) == {}


def test_balance_config_errors_name_the_field() -> None:
    bad = {
        "scheduler.domains.arith = -1.0: a weight must be non-negative": {"domains": {"arith": -1.0}},
        "scheduler.domains: every weight is 0": {"domains": {"arith": 0.0, "math": 0.0}},
        "scheduler.balance: floor 0.6 is above its cap 0.5": {"balance": {"floor": 0.6, "cap": 0.5}},
        "scheduler.balance: floor of 'arith' 0.6 is above its cap 0.5": {"balance": {"floors": {"arith": 0.6},
                                                                                       "cap": 0.5}},
        "scheduler.balance.caps.nope: not a source": {"balance": {"caps": {"nope": 0.5}}},
        "floors of 2 sources sum to 1.2 > 1": {"domains": {"arith": 1, "math": 1}, "balance": {"floor": 0.6}},
        "caps of 2 sources sum to 0.8 < 1": {"domains": {"arith": 1, "math": 1}, "balance": {"cap": 0.4}},
        "scheduler.balance.band": {"balance": {"band": [0.9, 0.1]}},
        "scheduler.balance.policy": {"balance": {"policy": "loudest"}},
    }
    for message, section in bad.items():
        with pytest.raises(ConfigError) as err:
            load_config(overrides={"scheduler": section})
        assert message in str(err.value) and "\n" not in str(err.value), (message, str(err.value))
    assert SchedulerConfig().balance_policy == "zero_variance"  # today's default, kept
    assert SchedulerConfig(rebalance=False).balance_policy == "static"
    assert SchedulerConfig(rebalance=False, balance={"policy": "signal"}).balance_policy == "signal"


@pytest.mark.anyio
async def test_the_scheduler_checkpoints_its_balancing_in_its_status() -> None:
    cfg = EngineConfig(namespace="balance", scheduler=SchedulerConfig(
        domains={"arith": 1.0, "math": 1.0}, balance={"policy": "signal", "window": 16}))
    store = MemoryStore()
    async with Runtime(cfg, event_log=MemoryEventLog(), store=store, instance="t") as rt:
        first = SchedulerActor(rt)
        await first.setup()
        for step in range(4):
            first.apply_snapshot({"instance": "r", "epoch": "e", "domains": {
                "arith": groups(4 * (step + 1), varied=0, solve=1.0),
                "math": groups(4 * (step + 1), varied=4 * (step + 1), solve=0.5)}})
        assert first.mixer.weights["arith"] < 0.1
        status = first.statistics()
        assert status["balance"]["arith"]["varied"] == 0 and status["balance"]["math"]["window_groups"] == 16
        assert "balance_state" not in status  # windows are checkpoint material, not metrics
        await first.put_status()

        second = SchedulerActor(rt)
        await second.setup()
        assert second.mixer.weights == first.mixer.weights and second.mixer.view() == first.mixer.view()
        # the writer's counters came back too: its next snapshot adds only what is new
        second.apply_snapshot({"instance": "r", "epoch": "e", "domains": {
            "arith": groups(16, varied=0, solve=1.0), "math": groups(16, varied=16, solve=0.5)}})
        assert second.mixer.view()["math"]["groups_seen"] == 16
        share = second.mixer.weights["math"]
        second.apply_eval({"math", "python"})  # the eval role's regression flags (python: not trained here)
        assert second.mixer.view()["math"]["regressed"] and second.mixer.weights["math"] > share


def test_the_dashboard_plots_sampling_and_gradient_shares() -> None:
    from ops.dashboard.recorder import gauges

    points = gauges({"scheduler": {"role": "scheduler", "balance": {"math": {"share": 0.7, "paused": False},
                                                                    "python": {"share": 0.0, "paused": True}}},
                     "learner": {"role": "learner", "step_domains": {"math": {"grad_share": 0.6}}}})
    assert set(points) == {("balance", "math", 0.7), ("balance", "python", 0.0), ("balance", "grad math", 0.6)}


class _Record:
    """The surface of a consumed record the reward actor's ``handle`` uses."""

    def __init__(self, message: object, message_id: str) -> None:
        self.message, self.message_id, self.acked = message, message_id, False

    def ack(self) -> None:
        self.acked = True


def _outcome(task_id: str, index: int, correct: bool, *, error: str = "") -> object:
    import numpy as np

    from engine.schemas import Completion, Outcome

    n = 3
    completion = Completion(
        sample_id=f"{task_id}/{index}", task_id=task_id, domain="arith", group_index=index, group_size=4,
        prompt_ids=np.arange(4, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
        logprobs=np.full(n, -0.5, np.float32), loss_mask=np.ones(n, np.uint8), weight_versions=np.zeros(n, np.int32),
        text="19" if correct else "18", finish_reason="stop", spec={"answer": "19"})
    return Outcome(completion=completion.to_body(), facts={} if error else {"correct": correct}, verifier="answer",
                   error=error)


@pytest.mark.anyio
async def test_the_reward_actor_counts_what_the_scheduler_differences() -> None:
    from actors.reward import RewardActor

    cfg = EngineConfig(namespace="rewardcounts")
    async with Runtime(cfg, event_log=MemoryEventLog(), store=MemoryStore(), instance="t") as rt:
        actor = RewardActor(rt)
        records = [_Record(_outcome("judged", i, c), f"j{i}") for i, c in enumerate((True, False, True, False))]
        records += [_Record(_outcome("broken", i, False, error="sandbox lost"), f"b{i}") for i in range(4)]
        for r in records:
            await actor.handle(r)  # type: ignore[arg-type]
        assert all(r.acked for r in records)  # both groups complete and emitted
        snap = actor.snapshot()
        s = snap["domains"]["arith"]
        assert (s["count"], s["correct_total"], s["groups"], s["zero_variance_groups"]) == (4, 2.0, 1, 0)
        assert (s["verifier_errors"], s["error_groups"]) == (4, 1)  # the all-error group is not a judged group
        assert snap["instance"] == "t/reward" and snap["epoch"]
        assert RewardActor(rt).epoch != actor.epoch  # a new actor's counters are a new epoch

    merger = RewardStatsMerger()
    mixer = signal_mixer({"arith": 1.0}, pause_after=4)
    for name, delta in merger.add(json.loads(json.dumps(snap))).items():
        mixer.observe(name, delta)
    view = mixer.view()["arith"]
    assert (view["window_groups"], view["solve"], view["varied"], view["verifier_errors"]) == (1, 0.5, 1.0, 4)
    assert not mixer.paused("arith")  # judged samples came with the errors: not a verifier that always fails
