"""Heartbeats: every supervised actor's statistics, published over core NATS at a fixed interval.

Each beat publishes one :class:`~engine.schemas.Heartbeat` per supervised actor, encoded with the
codec's envelope, on ``<ns>.heartbeat.<role>`` (``Names.subject("heartbeat", role)``). Its ``stats``
are the actor's ``statistics()`` made JSON-safe, plus what only the supervisor knows (``alive``,
``restarts``) and, for actors that consume Kafka, ``lag``: the records their consumer has not
committed yet (``Consumer.lag()``, summed over the member's partitions).

Heartbeats are plain core NATS publishes: nothing is stored, a subscriber sees what is published
while it listens (``rollout status``). A failed publish is logged and skipped: monitoring never
stops the work.

Wiring (``ops/deployment.py``)::

    heartbeater = Heartbeater(rt, supervisor, cfg.telemetry.heartbeat_s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeater.run)
        await supervisor.run()
        tg.cancel_scope.cancel()
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.actor import Actor, Supervisor
from engine.schemas import Heartbeat
from streams.codec import encode

if TYPE_CHECKING:
    from actors.runtime import Runtime

log = logging.getLogger("rollout.heartbeat")


@runtime_checkable
class CoreNats(Protocol):
    """A control store that also holds a core NATS connection (``streams.nats.Nats``): heartbeats are plain
    publishes, outside the :class:`~streams.protocols.ControlStore` protocol, so only such a store has them."""

    nc: Any


LAG_TIMEOUT_S = 2.0
"""Longest wait for one consumer's lag (it asks the broker for end and committed offsets)."""


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON/MessagePack types: str-keyed dicts, lists, finite numbers, str, None.

    Anything else (paths, enums, dataclasses) becomes its ``str()``; NaN and infinities become None;
    nesting deeper than 8 levels is cut (statistics are meant to be small and flat).
    """
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= 8:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, depth + 1) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return json_safe(value.item(), depth + 1)
        except (TypeError, ValueError):
            pass
    return str(value)


def actor_stats(supervisor: Supervisor, name: str, actor: Actor) -> dict[str, Any]:
    """One actor's JSON-safe statistics plus the supervisor's view of it (``alive``, ``restarts``)."""
    try:
        stats = json_safe(actor.statistics())
    except Exception as exc:  # a broken statistics() must not silence the other actors
        log.warning("statistics() of %s failed: %s", name, exc)
        stats = {"role": actor.role, "name": name, "error": f"{type(exc).__name__}: {exc}"}
    stats.setdefault("role", actor.role)
    stats.setdefault("name", name)
    stats["alive"] = supervisor.alive().get(name, False)
    stats["restarts"] = supervisor.restarts(name)
    return stats


async def consumer_lag(actor: Actor) -> int | None:
    """Records not yet committed by the actor's Kafka consumer, over its partitions; None if it has none."""
    consumer = getattr(actor, "consumer", None)
    lag = getattr(consumer, "lag", None)
    if lag is None:
        return None
    try:
        with anyio.fail_after(LAG_TIMEOUT_S):
            per_partition = await lag()
    except Exception as exc:  # the consumer may be closing or the broker slow: report no figure
        log.debug("lag of %s unavailable: %s", actor.name, exc)
        return None
    return sum(per_partition.values())


class Heartbeater:
    """Publishes a heartbeat per supervised actor every ``interval_s``; ``await heartbeater.run()``."""

    def __init__(self, rt: Runtime, supervisor: Supervisor, interval_s: float | None = None) -> None:
        self.rt = rt
        self.supervisor = supervisor
        self.interval_s = float(interval_s if interval_s is not None else rt.cfg.telemetry.heartbeat_s)
        if self.interval_s <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {self.interval_s}")
        self.producer = f"heartbeat/{rt.instance}"
        self.published = 0
        self.failures = 0
        self.lag: dict[str, int] = {}
        """Last sampled consumer lag per actor name (read by the dashboard recorder and LagCollector)."""

    def subject(self, role: str) -> str:
        return self.rt.names.subject("heartbeat", role)

    async def heartbeats(self) -> list[Heartbeat]:
        """This beat's messages, one per supervised actor (samples consumer lag on the way)."""
        out = []
        lag: dict[str, int] = {}
        for name, actor in self.supervisor.actors.items():
            stats = actor_stats(self.supervisor, name, actor)
            n = await consumer_lag(actor)
            if n is not None:
                stats["lag"] = lag[name] = n
            out.append(Heartbeat(role=str(stats["role"]), instance=self.rt.instance, stats=stats))
        self.lag = lag
        return out

    async def beat(self) -> int:
        """Publish one heartbeat per actor now; returns how many were published."""
        store = self.rt.control
        nc = store.nc if isinstance(store, CoreNats) else None
        if nc is None:
            raise RuntimeError("heartbeats need the runtime's NATS connection (core NATS publish)")
        sent = 0
        for hb in await self.heartbeats():
            data, _ = encode(hb, producer=self.producer)
            try:
                await nc.publish(self.subject(hb.role), data)
            except Exception as exc:  # on purpose: a lost heartbeat must not stop the work
                self.failures += 1
                log.warning("heartbeat of %s/%s not published: %s", hb.role, hb.stats.get("name"), exc)
                continue
            sent += 1
        self.published += sent
        return sent

    async def run(self) -> None:
        """Beat every ``interval_s`` until cancelled (the deployment's task group does)."""
        next_at = time.monotonic()
        while True:
            await self.beat()
            # a slow beat (lag queries) skips ticks instead of bursting to catch up
            next_at = max(next_at + self.interval_s, time.monotonic())
            await anyio.sleep(max(0.0, next_at - time.monotonic()))


class LagCollector(Collector):
    """``rollout_consumer_lag{role, actor}`` gauges from the heartbeater's last lag samples.

    Register with ``http.registry.register(LagCollector(heartbeater, supervisor))``.
    """

    def __init__(self, heartbeater: Heartbeater, supervisor: Supervisor) -> None:
        self.heartbeater = heartbeater
        self.supervisor = supervisor

    def collect(self) -> Iterable[GaugeMetricFamily]:
        fam = GaugeMetricFamily("rollout_consumer_lag", "records not yet committed by the actor's consumer group "
                                "member, summed over its partitions (sampled each heartbeat)",
                                labels=["role", "actor"])
        actors = self.supervisor.actors
        for name, lag in sorted(self.heartbeater.lag.items()):
            actor = actors.get(name)
            if actor is not None:
                fam.add_metric([actor.role, name], float(lag))
        yield fam
