"""Heartbeats without NATS: what one beat publishes, on which subjects, and how failures are absorbed."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import anyio
import pytest

from engine.actor import Actor, Supervisor
from engine.config import EngineConfig, TelemetryConfig
from engine.schemas import Heartbeat
from engine.topics import Names
from ops.heartbeat import Heartbeater, LagCollector, json_safe
from streams.codec import decode

pytestmark = pytest.mark.anyio


class FakeNc:
    def __init__(self, fail: bool = False) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.fail = fail

    async def publish(self, subject: str, data: bytes) -> None:
        if self.fail:
            raise ConnectionError("nats: connection closed")
        self.published.append((subject, data))


class FakeConsumer:
    async def lag(self) -> dict[tuple[str, int], int]:
        return {("ns.rollout.outcomes", 0): 3, ("ns.rollout.outcomes", 1): 4}


class RewardLike(Actor):
    role: ClassVar[str] = "reward"

    def __init__(self) -> None:
        super().__init__()
        self.consumer = FakeConsumer()

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(handled=7, checkpoint=Path("/tmp/ckpt"), loss=math.nan, domains={"arith": {"mean": 0.5}})
        return stats


class Broken(Actor):
    role: ClassVar[str] = "sandbox.verify"

    def statistics(self) -> dict[str, Any]:
        raise RuntimeError("boom")


def _runtime(nc: FakeNc, heartbeat_s: float = 2.0) -> Any:
    cfg = EngineConfig(namespace="ns", telemetry=TelemetryConfig(heartbeat_s=heartbeat_s))
    return SimpleNamespace(cfg=cfg, names=Names("ns"), instance="host-1", control=SimpleNamespace(nc=nc))


async def _running(supervisor: Supervisor, n: int) -> None:
    with anyio.fail_after(5):
        while len(supervisor.actors) < n:
            await anyio.sleep(0.01)


def test_json_safe_makes_plain_values() -> None:
    assert json_safe({"p": Path("/x"), 1: (1, 2.5), "nan": math.inf, "ok": None, "b": True}) == \
        {"p": "/x", "1": [1, 2.5], "nan": None, "ok": None, "b": True}


async def test_one_beat_publishes_each_actor_on_its_role_subject() -> None:
    nc = FakeNc()
    supervisor = Supervisor()
    supervisor.add("reward", RewardLike)
    supervisor.add("sandbox.verify", Broken)
    hb = Heartbeater(_runtime(nc), supervisor)
    assert hb.interval_s == 2.0
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        await _running(supervisor, 2)
        assert await hb.beat() == 2
        supervisor.drain()

    by_subject = {subject: decode(data, expect=("heartbeat",)) for subject, data in nc.published}
    assert set(by_subject) == {"ns.heartbeat.reward", "ns.heartbeat.sandbox.verify"}
    reward = by_subject["ns.heartbeat.reward"].message
    assert isinstance(reward, Heartbeat)
    assert (reward.role, reward.instance) == ("reward", "host-1")
    assert reward.stats["handled"] == 7 and reward.stats["checkpoint"] == "/tmp/ckpt" and reward.stats["loss"] is None
    assert reward.stats["alive"] is True and reward.stats["restarts"] == 0
    assert reward.stats["lag"] == 7 and hb.lag == {"reward": 7}
    broken = by_subject["ns.heartbeat.sandbox.verify"].message
    assert "boom" in broken.stats["error"] and broken.stats["name"] == "sandbox.verify"
    assert by_subject["ns.heartbeat.reward"].producer == "heartbeat/host-1"

    families = list(LagCollector(hb, supervisor).collect())
    assert [(s.labels, s.value) for s in families[0].samples] == [({"role": "reward", "actor": "reward"}, 7.0)]


async def test_failed_publishes_are_counted_not_raised() -> None:
    supervisor = Supervisor()
    supervisor.add("reward", RewardLike)
    hb = Heartbeater(_runtime(FakeNc(fail=True)), supervisor, interval_s=0.5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        await _running(supervisor, 1)
        assert await hb.beat() == 0
        supervisor.drain()
    assert hb.failures == 1 and hb.published == 0


async def test_run_beats_every_interval_until_cancelled() -> None:
    nc = FakeNc()
    supervisor = Supervisor()
    supervisor.add("reward", RewardLike)
    hb = Heartbeater(_runtime(nc), supervisor, interval_s=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        await _running(supervisor, 1)
        tg.start_soon(hb.run)
        with anyio.fail_after(5):
            while len(nc.published) < 4:
                await anyio.sleep(0.01)
        supervisor.drain()
        tg.cancel_scope.cancel()
    assert hb.published >= 4


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Heartbeater(_runtime(FakeNc()), Supervisor(), interval_s=0)
