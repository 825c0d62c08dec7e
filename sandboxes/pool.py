"""Opening sandboxes and pooling pre-warmed ones."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from sandboxes.base import Sandbox
from sandboxes.deathwatch import DeathWatch
from sandboxes.limits import Limits
from sandboxes.registry import sandbox_backend

log = logging.getLogger(__name__)

FDS_PER_SANDBOX = 4
"""Descriptors this process holds per sandbox at most: a bwrap sandbox keeps its control socket, and while a
command runs the read ends of its stdout/stderr pipes and its stdin (``loadtests/fleet.py --sandboxes``
measured 3 per busy sandbox, 1 per idle one); starting one briefly takes a few more."""
FD_RESERVE = 512
"""Descriptors kept for everything else of the process (Kafka and NATS connections, logs, the HTTP port)."""


def ensure_fd_headroom(max_sandboxes: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE so ``max_sandboxes`` busy sandboxes fit; the soft limit after.

    A common default soft limit is 1024 (systemd services, many shells): with it a pool of ~250 busy sandboxes
    fails with EMFILE ("Too many open files") in the middle of a run. The soft limit is raised up to the hard
    one; if even the hard limit is too low, a warning says how many sandboxes fit.
    """
    need = FD_RESERVE + FDS_PER_SANDBOX * max_sandboxes
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, target, exc)
    if soft < need:
        log.warning("max_sandboxes=%d needs about %d file descriptors, but RLIMIT_NOFILE is %d (hard %s): about "
                    "%d sandboxes can be busy at once before opening one fails with EMFILE; raise the hard limit "
                    "(ulimit -Hn, LimitNOFILE=) or lower max_sandboxes", max_sandboxes, need, soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard,
                    max(0, (soft - FD_RESERVE) // FDS_PER_SANDBOX))
    return soft


async def create_sandbox(backend: str = "bwrap", limits: Limits | None = None) -> Sandbox:
    """A new sandbox of ``backend`` (a name in :mod:`sandboxes.registry`); the caller closes it."""
    return await sandbox_backend(backend).create(limits or Limits())


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
    trimmed: int = 0
    """Idle sandboxes above the pool's size closed after ``idle_ttl_s`` unused."""


class SandboxPool:
    """Pre-warmed sandboxes of one backend and one :class:`Limits`.

    ``acquire()`` hands out an idle sandbox (creating one while fewer than ``max_size`` exist, else
    waiting); leaving it resets the sandbox to pristine before another user can get it. A reaper runs
    at start and every ``reap_interval_s`` for leftovers of dead processes, and a watcher process
    (:mod:`sandboxes.deathwatch`) reaps this pool's sandboxes within moments of this process dying,
    SIGKILL included (the periodic pass is then only the fallback). A burst grows the pool up
    to ``max_size``; idle sandboxes beyond ``size`` are closed once unused for ``idle_ttl_s`` (the
    most recently used are handed out first, so the surplus is what goes cold).

    At most ``max_starting`` sandboxes are being started at once. A thousand starts at once on a small
    host would each get a sliver of the CPU and run past the backend's start timeout together
    (``loadtests/fleet.py --sandboxes``: 318 of ~2,700 verifications failed that way while a pool grew
    to 1,000 on 2 cores); in turn, each start is quick. A checkout waiting for a start slot takes a
    sandbox released meanwhile instead (waiting for the slot alone left released sandboxes idle while
    hundreds of checkouts queued for starts).
    """

    def __init__(
        self,
        backend: str = "bwrap",
        limits: Limits | None = None,
        size: int = 4,
        max_size: int = 64,
        reap_interval_s: float = 60.0,
        idle_ttl_s: float = 60.0,
        max_starting: int = 8,
    ) -> None:
        if not 0 <= size <= max_size:
            raise ValueError(f"need 0 <= size <= max_size, got size={size} max_size={max_size}")
        if max_starting < 1:
            raise ValueError(f"max_starting must be >= 1, got {max_starting}")
        if not idle_ttl_s > 0:
            raise ValueError(f"idle_ttl_s must be > 0, got {idle_ttl_s}")
        sandbox_backend(backend)  # an unknown name fails here, naming the known ones, not at first use
        self.backend = backend
        self.limits = limits or Limits()
        self.size = size
        self.max_size = max_size
        self.reap_interval_s = reap_interval_s
        self.idle_ttl_s = idle_ttl_s
        # idle sandbox -> when it became idle; insertion order is age, so the end is the warmest
        self._idle: dict[Sandbox, float] = {}
        self._all: set[Sandbox] = set()
        self._creating = 0
        self.max_starting = max_starting
        self._prewarm = asyncio.Semaphore(max_starting)
        self._wakers: set[asyncio.Future[None]] = set()
        self._cond = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []  # the reaper and the trimmer
        self._closed = False
        self._created = self._resets = self._reaped = self._trimmed = 0
        self._deathwatch: DeathWatch | None = None

    async def start(self) -> SandboxPool:
        ensure_fd_headroom(self.max_size)
        await self.reap()
        if sandbox_backend(self.backend).reap is not None and self._deathwatch is None:
            try:
                self._deathwatch = DeathWatch(self.backend)
            except OSError as exc:  # the periodic pass still reaps, only later
                log.warning("cannot start the sandbox death watcher: %s", exc)
        self._tasks = [asyncio.ensure_future(self._every(self.reap_interval_s, self.reap, "reaper pass")),
                       asyncio.ensure_future(self._every(min(self.idle_ttl_s / 2, 30.0), self.trim, "trim"))]
        await asyncio.gather(*(self._add_idle() for _ in range(self.size)))
        return self

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _add_idle(self) -> None:
        async with self._prewarm:  # the start timeout then counts one start, not a queue of them
            sandbox = await create_sandbox(self.backend, self.limits)
        self._all.add(sandbox)
        self._created += 1
        async with self._cond:
            self._push_idle(sandbox)
            self._cond.notify()

    def _wake_one(self) -> None:
        """Wake one waiting checkout, without awaiting here (so a cancelled checkout cannot lose the wake-up
        or a sandbox it already counted)."""

        async def notify() -> None:
            async with self._cond:
                self._cond.notify()

        task = asyncio.ensure_future(notify())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    def _push_idle(self, sandbox: Sandbox) -> None:
        self._idle[sandbox] = time.monotonic()

    async def trim(self, now: float | None = None) -> int:
        """Close idle sandboxes beyond ``size`` unused for ``idle_ttl_s`` at ``now`` (monotonic); how many."""
        cutoff = (time.monotonic() if now is None else now) - self.idle_ttl_s
        async with self._cond:
            surplus = len(self._idle) - self.size
            # checkout takes the most recently idle: the coldest are at the front
            cold = [sb for sb, since in itertools.islice(self._idle.items(), max(0, surplus)) if since <= cutoff]
            for sandbox in cold:
                del self._idle[sandbox]
                self._all.discard(sandbox)
            if cold:
                self._cond.notify_all()  # room below max_size for a waiter
        results = await asyncio.gather(*(s.close() for s in cold), return_exceptions=True)
        for sandbox, result in zip(cold, results):
            if isinstance(result, BaseException):
                log.warning("closing idle sandbox %s failed: %s", sandbox.id, result)
        self._trimmed += len(cold)
        return len(cold)

    async def reap(self) -> None:
        reap = sandbox_backend(self.backend).reap
        if reap is not None:
            self._reaped += await reap()

    @staticmethod
    async def _every(interval_s: float, action: Callable[[], Awaitable[object]], what: str) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await action()
            except Exception:  # a bad pass must not end the loop; the next one retries
                log.exception("sandbox pool %s failed", what)

    async def checkout(self) -> Sandbox:
        """An idle sandbox, or a new one below ``max_size`` when fewer than ``max_starting`` are being
        started, waiting for whichever comes first otherwise; see :meth:`release`."""
        async with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("pool is closed")
                if self._idle:
                    sandbox, _ = self._idle.popitem()  # the most recently idle (LIFO)
                    return sandbox
                if len(self._all) + self._creating < self.max_size and self._creating < self.max_starting:
                    self._creating += 1
                    break
                await self._cond.wait()
        try:
            sandbox = await create_sandbox(self.backend, self.limits)
            self._all.add(sandbox)  # counted before the start slot is given back: max_size holds
            self._created += 1
        finally:
            self._creating -= 1
            self._wake_one()  # a start slot is free
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
            self._push_idle(sandbox)
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
            trimmed=self._trimmed,
        )

    async def close(self) -> None:
        """Close every sandbox; in-use ones are closed when released. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        async with self._cond:
            idle, self._idle = list(self._idle), {}
            self._cond.notify_all()
        for sandbox in idle:
            self._all.discard(sandbox)
        await asyncio.gather(*(s.close() for s in idle))
        if self._deathwatch is not None:
            watch, self._deathwatch = self._deathwatch, None
            await asyncio.to_thread(watch.close)


