"""Process-level tuning a long-running daemon applies once it has started.

A daemon's heap is dominated by what start-up left behind: imported modules (torch, transformers,
the OpenTelemetry SDK, pydantic), the model, tokenizers, actors. None of it becomes cyclic garbage,
yet every full collection of Python's cyclic garbage collector walks all of it: measured on the
rollout path (``loadtests/tracing_overhead.py``), the collector took about a tenth of the actors'
CPU. :func:`freeze_startup_heap` collects once and then moves every surviving object into the
collector's permanent generation (``gc.freeze``), so later collections walk only what was
allocated since. Reference counting still frees a frozen object as soon as nothing refers to it;
only a reference cycle among frozen objects that later becomes unreachable stays until the
process exits. At exit the heap is unfrozen again (``atexit``), so the interpreter's final
collections see everything, as extension modules that check for leaked objects at shutdown expect.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging

log = logging.getLogger("rollout.engine")


@dataclasses.dataclass(frozen=True)
class FrozenHeap:
    """What :func:`freeze_startup_heap` did: objects moved out of the collector's reach, and how many
    unreachable ones the collection before it freed."""

    frozen: int
    collected: int


_unfreeze_registered = False


def freeze_startup_heap() -> FrozenHeap:
    """Collect, then freeze every object alive now (call once start-up is done; idempotent)."""
    global _unfreeze_registered
    collected = gc.collect()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("gc: froze %d start-up objects (%d collected first)", frozen, collected)
    return FrozenHeap(frozen=frozen, collected=collected)


__all__ = ["FrozenHeap", "freeze_startup_heap"]
