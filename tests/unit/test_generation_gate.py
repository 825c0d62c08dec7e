"""GenerationGate: without partial rollouts a weight update waits for the streams in flight and holds new ones."""

from __future__ import annotations

import anyio
import pytest

from actors.inference.actor import GenerationGate
from engine.config import InferenceConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_update_waits_for_running_streams_and_holds_new_ones() -> None:
    gate = GenerationGate()
    events: list[str] = []
    release = anyio.Event()
    update_has_gate = anyio.Event()

    async def stream(name: str, hold: anyio.Event | None) -> None:
        async with gate.stream():
            events.append(f"{name} start")
            if hold is not None:
                await hold.wait()
            events.append(f"{name} end")

    async def update() -> None:
        async with gate.exclusive():
            events.append("update")
            update_has_gate.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, "a", release)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(update)
            await anyio.wait_all_tasks_blocked()
            assert gate.closed and "update" not in events  # a is still running
            tg.start_soon(stream, "b", None)
            await anyio.wait_all_tasks_blocked()
            assert "b start" not in events  # held back while the update waits
            release.set()
            await update_has_gate.wait()
    assert events == ["a start", "a end", "update", "b start", "b end"]
    assert gate.active == 0 and not gate.closed


async def test_two_updates_take_turns() -> None:
    gate = GenerationGate()
    inside = 0
    most = 0

    async def update() -> None:
        nonlocal inside, most
        async with gate.exclusive():
            inside += 1
            most = max(most, inside)
            await anyio.sleep(0)
            inside -= 1

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(update)
    assert most == 1 and not gate.closed


def test_partial_rollouts_is_the_default() -> None:
    assert InferenceConfig().partial_rollouts is True
    assert InferenceConfig(partial_rollouts=False).partial_rollouts is False
