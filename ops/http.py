"""The daemon's HTTP endpoints: health, Prometheus metrics, a JSON status, and the control surface.

- ``GET /healthz``: 200 ``{"ok": true, "actors": {...}}`` while every supervised actor is alive,
  503 otherwise.
- ``GET /metrics``: Prometheus text. Every numeric field of every actor's ``statistics()`` becomes a
  gauge ``rollout_<field>{role=..., actor=...}`` read at scrape time (no counters kept twice), plus
  collectors registered by the deployment (consumer lag from the heartbeats).
- ``GET /status``: the same statistics as JSON.
- ``POST /drain``: starts a graceful drain; needs ``Authorization: Bearer <control_token>`` (state-
  changing endpoints refuse to run without a configured token).

Binds loopback by default (telemetry.http_host).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, cast

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.actor import Supervisor

log = logging.getLogger("rollout.http")


def _flatten(prefix: str, value: Any) -> Iterable[tuple[str, float]]:
    if isinstance(value, bool):
        yield prefix, float(value)
    elif isinstance(value, (int, float)):
        if math.isfinite(value):
            yield prefix, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and k.replace("_", "").isalnum():
                yield from _flatten(f"{prefix}_{k}", v)


class ActorStatsCollector(Collector):
    """Exposes actors' ``statistics()`` snapshots as gauges, at scrape time."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for name, actor in self.supervisor.actors.items():
            try:
                stats = actor.statistics()
            except Exception as exc:  # a broken statistics() must not break the scrape
                log.warning("statistics() of %s failed: %s", name, exc)
                continue
            role = str(stats.get("role", actor.role))
            for key, value in stats.items():
                if key in ("role", "name"):
                    continue
                for metric, v in _flatten(f"rollout_{key}", value):
                    fam = families.get(metric)
                    if fam is None:
                        fam = families[metric] = GaugeMetricFamily(metric, f"actor statistic {metric}",
                                                                   labels=["role", "actor"])
                    fam.add_metric([role, name], v)
            restarts = families.setdefault("rollout_actor_restarts", GaugeMetricFamily(
                "rollout_actor_restarts", "restarts of the actor by its supervisor", labels=["role", "actor"]))
            restarts.add_metric([role, name], float(self.supervisor.restarts(name)))
        yield from families.values()


class HttpServer:
    """``async with HttpServer(host, port, supervisor, token) as srv: srv.url``."""

    def __init__(self, host: str, port: int, supervisor: Supervisor, *, control_token: str | None = None,
                 registry: CollectorRegistry | None = None,
                 extra_routes: Callable[[web.Application], None] | None = None) -> None:
        self.host = host
        self.port = port
        self.supervisor = supervisor
        self.control_token = control_token
        self.registry = registry or CollectorRegistry()
        self.registry.register(ActorStatsCollector(supervisor))
        self.app = web.Application()
        self.app.add_routes([web.get("/healthz", self.healthz), web.get("/metrics", self.metrics),
                             web.get("/status", self.status), web.post("/drain", self.drain)])
        if extra_routes is not None:
            extra_routes(self.app)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> "HttpServer":
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = cast(asyncio.Server, site._server).sockets if site._server else []  # the bound port when port=0
        port = sockets[0].getsockname()[1] if sockets else self.port
        self.url = f"http://{self.host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _snapshot(self) -> dict[str, Any]:
        out = {}
        for name, actor in self.supervisor.actors.items():
            try:
                out[name] = actor.statistics()
            except Exception as exc:
                out[name] = {"error": str(exc)}
        return out

    async def healthz(self, request: web.Request) -> web.Response:
        actors = self.supervisor.actors
        alive = self.supervisor.alive()
        ok = bool(actors) and all(alive.values())
        return web.json_response({"ok": ok, "actors": alive}, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self._snapshot(), dumps=_dumps)

    async def drain(self, request: web.Request) -> web.Response:
        if not self.control_token:
            return web.json_response({"error": "control endpoints are disabled: set telemetry.control_token"},
                                     status=403)
        scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
        # compare bytes: compare_digest raises TypeError (a 500) on non-ASCII str input
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                                 self.control_token.encode()):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        self.supervisor.drain()
        return web.json_response({"draining": True})


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, default=str)
