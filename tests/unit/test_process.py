"""engine.process: the start-up heap is frozen out of the cyclic collector's reach, cycles made
afterwards are still collected, and unfreezing gives the frozen ones back."""

from __future__ import annotations

import gc
import weakref

from engine.process import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    node = Node()
    node.other = node
    return weakref.ref(node)


def test_freeze_moves_the_live_heap_out_and_later_cycles_are_still_collected() -> None:
    holder = [Node()]
    holder[0].other = holder[0]
    frozen_cycle = weakref.ref(holder[0])
    try:
        result = freeze_startup_heap()
        assert result.frozen == gc.get_freeze_count() > 0
        holder.clear()  # the frozen cycle is now garbage, but out of the collector's reach
        gc.collect()
        assert frozen_cycle() is not None
        later = cycle()  # made after the freeze: collected as usual
        gc.collect()
        assert later() is None
        assert freeze_startup_heap().frozen >= result.frozen  # again: idempotent
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen_cycle() is None and gc.get_freeze_count() == 0
