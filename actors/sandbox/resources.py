"""The one sandbox pool of a process, shared (reference-counted) by its episode and verify actors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from actors.runtime import Runtime, StreamActor
from actors.sandbox.settings import SandboxSettings
from engine.config import SandboxConfig
from sandboxes import Limits, SandboxError, SandboxPool
from streams.protocols import TransportError


class SandboxResources:
    """The one :class:`SandboxPool` of a process, shared by its sandbox actors (reference-counted).

    ``async with SandboxResources(cfg) as res`` holds a reference for the block; each actor holds one
    from its ``setup`` to its ``teardown``. The pool starts with the first reference and closes with
    the last.
    """

    def __init__(self, cfg: SandboxConfig, settings: SandboxSettings | None = None) -> None:
        self.cfg = cfg
        self.settings = settings or SandboxSettings()
        self.limits = Limits(memory_mb=cfg.memory_mb, pids=cfg.pids, timeout_s=cfg.timeout_s)
        self._pool: SandboxPool | None = None
        self._refs = 0
        self._lock = asyncio.Lock()

    @property
    def pool(self) -> SandboxPool:
        if self._pool is None:
            raise RuntimeError("SandboxResources is not acquired")
        return self._pool

    def pool_statistics(self) -> dict[str, int] | None:
        """The shared pool's :class:`~sandboxes.pool.PoolStatistics` as a dict; None while no pool runs."""
        return dataclasses.asdict(self._pool.statistics()) if self._pool is not None else None

    @property
    def max_episodes(self) -> int:
        return max(1, int(self.cfg.max_sandboxes * self.settings.episode_share))

    async def acquire(self) -> SandboxPool:
        async with self._lock:
            if self._pool is None:
                pool = SandboxPool(self.cfg.backend, self.limits, size=min(self.cfg.pool_size, self.cfg.max_sandboxes),
                                   max_size=self.cfg.max_sandboxes, idle_ttl_s=self.cfg.idle_ttl_s,
                                   max_starting=self.cfg.start_concurrency)
                try:
                    await pool.start()
                except SandboxError as exc:
                    await pool.close()
                    raise TransportError(f"cannot start the {self.cfg.backend} sandbox pool: {exc}") from exc
                self._pool = pool
            self._refs += 1
            return self._pool

    async def release(self) -> None:
        async with self._lock:
            self._refs -= 1
            if self._refs == 0 and self._pool is not None:
                pool, self._pool = self._pool, None
                await pool.close()

    async def __aenter__(self) -> SandboxResources:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


@contextlib.asynccontextmanager
async def sandbox_resources(cfg: SandboxConfig, settings: SandboxSettings | None = None) -> AsyncIterator[SandboxResources]:
    """``async with sandbox_resources(cfg.sandbox) as res:`` the shared pool, started and closed."""
    async with SandboxResources(cfg, settings) as resources:
        yield resources


class _SandboxActorBase(StreamActor):
    """Holds a reference to the shared resources from setup to teardown."""

    def __init__(self, rt: Runtime, resources: SandboxResources, name: str | None = None) -> None:
        super().__init__(rt, name)
        self.resources = resources
        self.concurrency = resources.cfg.max_sandboxes
        self._holding = False

    async def setup(self) -> None:
        await self.resources.acquire()
        self._holding = True
        await super().setup()

    async def teardown(self) -> None:
        try:
            await super().teardown()
        finally:
            if self._holding:
                self._holding = False
                await self.resources.release()

    def statistics(self) -> dict[str, Any]:
        """The stream actor's counters and ``pool``: the shared pool's idle / in_use / created / resets /
        reaped / trimmed (both sandbox actors of a process report the same pool)."""
        stats = super().statistics()
        if (pool := self.resources.pool_statistics()) is not None:
            stats["pool"] = pool
        return stats
