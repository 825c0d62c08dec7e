"""Reward logic without infrastructure: Welford statistics, advantages, group assembly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from domains import RewardBreakdown
from actors.reward import Arrival, DomainStats, GroupAssembler, Welford, experience_message_id, group_advantages, \
    is_zero_variance


def test_welford_matches_numpy() -> None:
    xs = [random.Random(1).gauss(3, 2) for _ in range(1000)]
    w = Welford()
    for x in xs:
        w.update(x)
    assert w.count == 1000
    assert w.mean == pytest.approx(np.mean(xs))
    assert w.std == pytest.approx(np.std(xs))
    assert Welford().std == 0.0


def test_domain_stats_snapshot() -> None:
    s = DomainStats()
    for c in (1.0, 0.0, 1.0, 1.0):
        s.observe(RewardBreakdown(correctness=c, format=0.0, tokens=1, total=c))
    s.groups, s.zero_variance_groups = 4, 1
    snap = s.snapshot()
    assert snap["count"] == 4 and snap["mean"] == 0.75 and snap["zero_variance_rate"] == 0.25
    assert 0.9 < snap["success"] < 1.0  # an exponential average starting at the first sample


@pytest.mark.parametrize("normalize", ["group", "group_std", "domain"])
def test_advantages_sum_to_zero(normalize: str) -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5], normalize, domain_std=0.4)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert adv[0] > adv[4] > adv[1]


def test_advantage_scaling() -> None:
    assert group_advantages([1.0, 0.0], "group") == pytest.approx([0.5, -0.5])
    assert group_advantages([1.0, 0.0], "group_std") == pytest.approx([1.0, -1.0], rel=1e-5)
    assert group_advantages([1.0, 0.0], "domain", domain_std=0.25) == pytest.approx([2.0, -2.0], rel=1e-4)
    assert group_advantages([1.0, 1.0], "group_std") == [0.0, 0.0]  # eps keeps it finite
    assert group_advantages([], "group") == []
    with pytest.raises(ValueError):
        group_advantages([1.0], "bogus")


def test_zero_variance() -> None:
    assert is_zero_variance([1.0, 1.0, 1.0]) and is_zero_variance([0.3])
    assert not is_zero_variance([1.0, 0.0])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_group_completes_and_deduplicates() -> None:
    g: GroupAssembler[str] = GroupAssembler(10.0, clock=Clock())
    assert g.add("t", "s0", 3, "a") is Arrival.PENDING
    assert g.add("t", "s0", 3, "a again") is Arrival.DUPLICATE
    assert g.add("t", "s1", 3, "b") is Arrival.PENDING
    assert g.add("t", "s2", 3, "c") is Arrival.COMPLETE
    assert g.take("t") == ["a", "b", "c"]
    assert g.take("t") == []
    assert g.add("t", "s1", 3, "b") is Arrival.DUPLICATE  # a re-delivery after the flush
    assert g.pending_groups == 0


def test_group_timeout_then_straggler() -> None:
    clock = Clock()
    g: GroupAssembler[str] = GroupAssembler(5.0, clock=clock)
    g.add("t", "s0", 3, "a")
    clock.now = 2.0
    g.add("u", "s0", 3, "x")
    g.add("t", "s1", 3, "b")
    clock.now = 4.9
    assert g.expired() == []
    clock.now = 5.0
    assert g.expired() == ["t"]
    assert g.pending_samples == 3
    assert g.take("t") == ["a", "b"]
    assert g.add("t", "s2", 3, "c") is Arrival.STRAGGLER
    assert g.add("t", "s2", 3, "c") is Arrival.DUPLICATE
    clock.now = 7.0
    assert g.expired() == ["u"]


def test_flushed_groups_are_forgotten_beyond_the_memory() -> None:
    g: GroupAssembler[str] = GroupAssembler(5.0, remember=2, clock=Clock())
    for t in ("a", "b", "c"):
        g.add(t, "s", 1, t)
        g.take(t)
    assert g.add("c", "s2", 2, "late") is Arrival.STRAGGLER
    assert g.add("a", "s2", 2, "new") is Arrival.PENDING  # forgotten: starts a new group


def test_experience_message_id_is_stable() -> None:
    assert experience_message_id("s1") == experience_message_id("s1") != experience_message_id("s2")
    assert len(experience_message_id("x" * 1000)) <= 128
