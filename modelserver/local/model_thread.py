"""The one thread that runs a model server's torch work: construction, steps, re-scoring, weight swaps.

Why one thread, and why not the event loop's: PyTorch's CPU kernels parallelise with GNU OpenMP (libgomp),
and every OS thread that runs a parallel region becomes the master of its own team of helper threads, kept
for the thread's lifetime. Once the process's OpenMP threads outnumber its CPUs, libgomp stops spinning
between regions (``do_spin``: ``gomp_throttled_spin_count_var``, about a hundred spins instead of
~300,000) and parks its helpers on a futex, so each of a decode step's hundreds of small parallel regions
pays a sleep and a wake-up. Two threads doing torch work with 2 intra-op threads each on a 2-core machine
are enough: the engine's steps on ``anyio.to_thread`` after a constructor on the loop thread took
25-29 s for the 32-request benchmark with ~75,000 voluntary context switches, against 11-12 s and ~120
with every torch operation on this thread (``docs/inference.md``, "the thread the step runs on").

So the engine builds its store, steps, re-scores and swaps weights here, and the event loop only plans
(tiny tensor copies at admission stay on the loop). The thread sets its own intra-op thread count when it
starts (OpenMP's count is per thread): by default the creating thread's.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import anyio
import torch

T = TypeVar("T")


class ModelThread:
    """One long-lived worker thread; ``call`` from synchronous code, ``await run(...)`` from the event loop."""

    def __init__(self, threads: int | None = None, *, name: str = "model") -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 (None: the creating thread's count), got {threads}")
        self.threads = threads if threads is not None else torch.get_num_threads()
        """Intra-op threads of torch work run here."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident = self._executor.submit(self._start).result()

    def _start(self) -> int:
        torch.set_num_threads(self.threads)
        return threading.get_ident()

    @property
    def on_it(self) -> bool:
        """True when the caller runs on this thread (a nested ``call`` then runs inline)."""
        return threading.get_ident() == self._ident

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the model thread and wait for it (blocks the caller: construction only)."""
        if self.on_it:
            return fn(*args)
        return self._executor.submit(contextvars.copy_context().run, fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the model thread; the event loop keeps serving meanwhile.

        Like ``anyio.to_thread.run_sync``, a cancelled caller still waits for the call to finish (a step
        half-applied to the KV store must not be abandoned).
        """
        future = self._executor.submit(contextvars.copy_context().run, fn, *args)
        with anyio.CancelScope(shield=True):
            result = await asyncio.wrap_future(future)
        return result

    def close(self) -> None:
        """Let the thread exit once its queued calls ran (its OpenMP team goes with it); idempotent."""
        self._executor.shutdown(wait=False)
