"""One lifecycle for every actor, and a supervisor that restarts crashed actors with backoff.

An actor's life is ``setup() -> serve() -> teardown()``, driven by ``run()``:

- ``serve()`` does the work and returns once ``draining`` is set and in-flight work is finished
  (or handed back). An exception from ``serve()`` is a crash.
- ``request_drain()`` asks it to finish; it is idempotent and safe from any task.
- ``teardown()`` always runs, even on crash or cancellation, and must be idempotent.

The supervisor runs each actor in its own task of one anyio task group. A crashed actor is rebuilt
from its factory and restarted after an exponential backoff; more than ``max_restarts`` crashes
within ``restart_window_s`` is fatal: the supervisor raises ``SupervisorGaveUp`` (never a silent
loop). SIGTERM maps to ``drain()``: every actor is asked to drain, and those still running after
``drain_timeout_s`` are cancelled.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import anyio

log = logging.getLogger("rollout.engine")


class Actor:
    """Base class of the five roles (and of test actors)."""

    role: ClassVar[str] = "actor"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.role
        self._drain_requested = anyio.Event()
        self._started_at: float | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def setup(self) -> None:
        """Acquire resources (connections, pools). Default: nothing."""

    async def serve(self) -> None:
        """Do the work until draining; subclasses implement."""
        await self._drain_requested.wait()

    async def teardown(self) -> None:
        """Release resources; always called, must be idempotent."""

    async def run(self) -> None:
        """The whole life of the actor: setup, serve, teardown (shielded)."""
        self._started_at = time.monotonic()
        try:
            await self.setup()
            await self.serve()
        finally:
            with anyio.CancelScope(shield=True):
                await self.teardown()

    def request_drain(self) -> None:
        """Ask the actor to finish its in-flight work and return from serve(). Idempotent."""
        self._drain_requested.set()

    @property
    def draining(self) -> bool:
        return self._drain_requested.is_set()

    async def wait_drain_requested(self) -> None:
        await self._drain_requested.wait()

    def statistics(self) -> dict[str, Any]:
        """An immutable snapshot of the actor's counters (heartbeats and metrics read it)."""
        up = 0.0 if self._started_at is None else time.monotonic() - self._started_at
        return {"role": self.role, "name": self.name, "uptime_s": round(up, 3)}


class SupervisorGaveUp(RuntimeError):
    """An actor crashed more often than its restart budget allows."""

    def __init__(self, name: str, restarts: int, window_s: float, last_error: BaseException) -> None:
        super().__init__(
            f"actor {name!r} crashed {restarts} times within {window_s:.0f}s; giving up. "
            f"Last error: {type(last_error).__name__}: {last_error}")
        self.name = name
        self.restarts = restarts
        self.last_error = last_error


@dataclasses.dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5
    restart_window_s: float = 60.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_initial_s * (2.0 ** max(0, attempt - 1)))


class ActorSpec(NamedTuple):
    """An actor for a :class:`Supervisor`: its name, how to make it, and the actors it drains after."""

    name: str
    factory: Callable[[], Actor]
    drain_after: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True)
class _Slot:
    factory: Callable[[], Actor]
    drain_after: tuple[str, ...]
    drain_requested: anyio.Event
    actor: Actor | None = None
    restarts: int = 0
    crash_times: deque[float] = dataclasses.field(default_factory=deque)
    finished: bool = False


class Supervisor:
    """Runs actors in one task group; restarts crashed ones; drains all on request.

    An actor added with ``drain_after=(names)`` is asked to drain only once those actors (the ones
    supervised here) have finished: a role that serves another's in-flight work (the sandbox
    episodes of the inference actor's multi-turn generations) stays up until that work is done.
    ``drain_timeout_s`` bounds the whole drain.
    """

    def __init__(self, policy: RestartPolicy | None = None, drain_timeout_s: float = 30.0) -> None:
        self.policy = policy or RestartPolicy()
        self.drain_timeout_s = drain_timeout_s
        self._slots: dict[str, _Slot] = {}
        self._draining = anyio.Event()
        self._all_done = anyio.Event()

    def add(self, name: str, factory: Callable[[], Actor], *, drain_after: tuple[str, ...] = ()) -> None:
        if name in self._slots:
            raise ValueError(f"an actor named {name!r} is already supervised")
        if name in drain_after:
            raise ValueError(f"actor {name!r} cannot drain after itself")
        self._slots[name] = _Slot(factory=factory, drain_after=tuple(drain_after), drain_requested=anyio.Event())

    def add_spec(self, spec: ActorSpec) -> None:
        """``add`` an :class:`ActorSpec` (what role builders such as ``build_sandbox_actors`` return)."""
        self.add(spec.name, spec.factory, drain_after=spec.drain_after)

    @property
    def actors(self) -> dict[str, Actor]:
        """The live actor instances by name (a new object after each restart)."""
        return {n: s.actor for n, s in self._slots.items() if s.actor is not None}

    def restarts(self, name: str) -> int:
        return self._slots[name].restarts

    def alive(self) -> dict[str, bool]:
        """Name -> whether the actor is still running (not returned, not given up)."""
        return {n: s.actor is not None and not s.finished for n, s in self._slots.items()}

    def finished(self, name: str) -> bool:
        """Whether ``name`` has stopped for good (returned after a drain, or given up); False before it starts."""
        slot = self._slots.get(name)
        return slot is not None and slot.finished

    def drain(self) -> None:
        """Ask every actor to drain (those with ``drain_after`` once those have finished); idempotent."""
        self._draining.set()
        self._request_ready_drains()

    def _request_ready_drains(self) -> None:
        if not self._draining.is_set():
            return
        for slot in self._slots.values():
            if slot.drain_requested.is_set():
                continue
            if all(self._slots[d].finished for d in slot.drain_after if d in self._slots):
                slot.drain_requested.set()
                if slot.actor is not None:
                    slot.actor.request_drain()

    async def run(self) -> None:
        """Run until every actor has returned (after drain) or one exhausts its restarts."""
        if not self._slots:
            return
        try:
            async with anyio.create_task_group() as tg:
                for name, slot in self._slots.items():
                    tg.start_soon(self._keep_running, name, slot)
                tg.start_soon(self._enforce_drain_timeout, tg.cancel_scope)
                await self._all_done.wait()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Surface the first give-up as itself, not wrapped: callers catch SupervisorGaveUp.
            gave_up = group.subgroup(SupervisorGaveUp)
            if gave_up is not None:
                raise _first_leaf(gave_up) from group
            raise

    def _mark_finished(self, slot: _Slot) -> None:
        slot.finished = True
        if all(s.finished for s in self._slots.values()):
            self._all_done.set()
        self._request_ready_drains()  # whoever waited for this one to finish

    async def _enforce_drain_timeout(self, scope: anyio.CancelScope) -> None:
        await self._draining.wait()
        await anyio.sleep(self.drain_timeout_s)
        pending = [n for n, s in self._slots.items() if not s.finished]
        log.warning("drain timeout after %.1fs; cancelling %s", self.drain_timeout_s, pending)
        scope.cancel()

    async def _keep_running(self, name: str, slot: _Slot) -> None:
        while True:
            slot.actor = slot.factory()
            if slot.drain_requested.is_set():
                slot.actor.request_drain()
            try:
                await slot.actor.run()
            except Exception as exc:  # a crash: restart within budget, else fail loudly
                if slot.drain_requested.is_set():
                    log.warning("actor %s failed while draining: %r", name, exc)
                    self._mark_finished(slot)
                    return
                now = time.monotonic()
                slot.crash_times.append(now)
                while slot.crash_times and now - slot.crash_times[0] > self.policy.restart_window_s:
                    slot.crash_times.popleft()
                if len(slot.crash_times) > self.policy.max_restarts:
                    log.error("actor %s exhausted its restarts", name, exc_info=exc)
                    raise SupervisorGaveUp(name, len(slot.crash_times), self.policy.restart_window_s, exc) from exc
                slot.restarts += 1
                delay = self.policy.backoff(len(slot.crash_times))
                log.warning("actor %s crashed (%s: %s); restart %d in %.2fs",
                            name, type(exc).__name__, exc, slot.restarts, delay, exc_info=exc)
                with anyio.move_on_after(delay):
                    await slot.drain_requested.wait()
                if slot.drain_requested.is_set():
                    self._mark_finished(slot)
                    return
                continue
            self._mark_finished(slot)
            return


def describe_error(exc: BaseException) -> str:
    """One line naming what went wrong: ``Type: message``, and for an exception group (a task group's
    failure) its leaf exceptions instead of the group's "unhandled errors in a TaskGroup"."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(exc)
    return "; ".join(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__ for e in leaves)


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
