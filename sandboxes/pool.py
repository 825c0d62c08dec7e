"""Opening sandboxes and pooling pre-warmed ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sandboxes.base import Sandbox
from sandboxes.limits import Limits

log = logging.getLogger(__name__)

BACKENDS = ("bwrap", "docker")


async def create_sandbox(backend: str = "bwrap", limits: Limits | None = None) -> Sandbox:
    """A new sandbox of ``backend``; the caller closes it."""
    limits = limits or Limits()
    if backend == "bwrap":
        from sandboxes.bwrap import BwrapSandbox

        return await BwrapSandbox.create(limits)
    if backend == "docker":
        from sandboxes.docker_backend import DockerSandbox

        return await DockerSandbox.create(limits)
    raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {BACKENDS}")


@contextlib.asynccontextmanager
async def open_sandbox(backend: str = "bwrap", limits: Limits | None = None) -> AsyncIterator[Sandbox]:
    """``async with open_sandbox("bwrap", Limits(...)) as sb: await sb.exec("...")``."""
    sandbox = await create_sandbox(backend, limits)
    try:
        yield sandbox
    finally:
        await sandbox.close()


@dataclass(frozen=True)
class PoolStatistics:
    idle: int
    in_use: int
    created: int
    resets: int
    reaped: int


class SandboxPool:
    """Pre-warmed sandboxes of one backend and one :class:`Limits`.

    ``acquire()`` hands out an idle sandbox (creating one while fewer than ``max_size`` exist, else
    waiting); leaving it resets the sandbox to pristine before another user can get it. A reaper runs
    at start and every ``reap_interval_s`` for leftovers of dead processes.
    """

    def __init__(
        self,
        backend: str = "bwrap",
        limits: Limits | None = None,
        size: int = 4,
        max_size: int = 64,
        reap_interval_s: float = 60.0,
    ) -> None:
        if not 0 <= size <= max_size:
            raise ValueError(f"need 0 <= size <= max_size, got size={size} max_size={max_size}")
        self.backend = backend
        self.limits = limits or Limits()
        self.size = size
        self.max_size = max_size
        self.reap_interval_s = reap_interval_s
        self._idle: list[Sandbox] = []
        self._all: set[Sandbox] = set()
        self._creating = 0
        self._cond = asyncio.Condition()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self._created = self._resets = self._reaped = 0

    async def start(self) -> SandboxPool:
        await self.reap()
        self._reaper = asyncio.ensure_future(self._reap_forever())
        await asyncio.gather(*(self._add_idle() for _ in range(self.size)))
        return self

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _add_idle(self) -> None:
        sandbox = await create_sandbox(self.backend, self.limits)
        self._all.add(sandbox)
        self._created += 1
        async with self._cond:
            self._idle.append(sandbox)
            self._cond.notify()

    async def reap(self) -> None:
        if self.backend == "bwrap":
            from sandboxes.reaper import reap

            self._reaped += reap().sandboxes
        elif self.backend == "docker":
            from sandboxes.docker_backend import reap_containers

            self._reaped += await reap_containers()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                await self.reap()
            except Exception:  # the reaper must outlive a bad pass; the next one retries
                log.exception("sandbox reaper pass failed")

    async def checkout(self) -> Sandbox:
        """An idle sandbox (or a new one below max_size), waiting for one otherwise; see :meth:`release`."""
        async with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("pool is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._all) + self._creating < self.max_size:
                    self._creating += 1
                    break
                await self._cond.wait()
        try:
            sandbox = await create_sandbox(self.backend, self.limits)
        finally:
            self._creating -= 1
        self._all.add(sandbox)
        self._created += 1
        return sandbox

    async def release(self, sandbox: Sandbox) -> None:
        """Reset ``sandbox`` and make it available again (closed instead if the reset fails)."""
        try:
            await sandbox.reset()
            self._resets += 1
        except Exception:
            log.exception("reset of %s failed; replacing it", sandbox.id)
            self._all.discard(sandbox)
            await sandbox.close()
            return
        async with self._cond:
            if self._closed:
                self._all.discard(sandbox)
                await sandbox.close()
                return
            self._idle.append(sandbox)
            self._cond.notify()

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Sandbox]:
        """``async with pool.acquire() as sb:`` a pristine sandbox, reset when the block exits."""
        sandbox = await self.checkout()
        try:
            yield sandbox
        finally:
            await asyncio.shield(self.release(sandbox))

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            idle=len(self._idle),
            in_use=len(self._all) - len(self._idle),
            created=self._created,
            resets=self._resets,
            reaped=self._reaped,
        )

    async def close(self) -> None:
        """Close every sandbox; in-use ones are closed when released. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        async with self._cond:
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for sandbox in idle:
            self._all.discard(sandbox)
        await asyncio.gather(*(s.close() for s in idle))


