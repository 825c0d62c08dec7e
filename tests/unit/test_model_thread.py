"""The model thread: every torch operation of the local engine on one thread (one OpenMP team per process)."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
import torch

from modelserver.llm import load_model_dir, write_tiny_model_dir
from modelserver.local.engine import LocalEngine
from modelserver.local.model_thread import ModelThread
from modelserver.local.protocol import SamplingParams


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_calls_run_on_one_thread_that_is_not_the_callers_with_its_own_torch_thread_count() -> None:
    before = torch.get_num_threads()
    thread = ModelThread(1)
    try:
        idents = {thread.call(threading.get_ident) for _ in range(5)}
        assert len(idents) == 1 and threading.get_ident() not in idents
        assert thread.call(torch.get_num_threads) == 1
        assert torch.get_num_threads() == before  # the caller's count is its own
        assert thread.call(lambda: thread.call(threading.get_ident)) in idents  # nested: inline, no deadlock
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 // 0)  # the call's error reaches the caller
    finally:
        thread.close()
    with pytest.raises(ValueError, match="threads must be >= 1"):
        ModelThread(0)


@pytest.mark.anyio
async def test_a_cancelled_caller_still_waits_for_the_call_to_finish() -> None:
    thread = ModelThread(1)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    returned = anyio.Event()
    finished_when_returned: list[bool] = []

    def slow() -> None:
        started.set()
        release.wait(10)
        finished.set()

    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            await thread.run(slow)
        finished_when_returned.append(finished.is_set())
        returned.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            assert await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()
            with anyio.move_on_after(0.5):  # an unshielded caller would return now, its call still running
                await returned.wait()
            release.set()
        assert finished_when_returned == [True]
    finally:
        thread.close()


@pytest.mark.anyio
async def test_the_engine_builds_steps_and_swaps_weights_on_its_model_thread(tmp_path: Path) -> None:
    model_dir = write_tiny_model_dir(tmp_path / "model", seed=0)
    model, tok = load_model_dir(model_dir)
    seen: dict[str, set[int]] = {}
    thread = ModelThread(1)

    def record(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    model.load_state_dict = record("load_state_dict", model.load_state_dict)  # type: ignore[method-assign]
    engine = LocalEngine(model, tok, max_batch=4, chunk_size=16, model_thread=thread)
    engine.runner.step = record("step", engine.runner.step)  # type: ignore[method-assign]
    await engine.start()
    try:
        seqs = [engine.submit(tok.encode(p), SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True,
                                                             sampling_seed=i))
                for i, p in enumerate(["def f(x):", "1+2="])]
        for seq in seqs:
            while not seq.finished:
                await seq.wait_changed()
        assert all(len(seq.output_ids) == 6 for seq in seqs)
        await engine.update_weights_from_disk(str(model_dir), weight_version="2")
        assert engine.weight_version == "2"
    finally:
        await engine.aclose()
    await engine.aclose()  # idempotent: the store is not closed twice
    model_ident = thread.call(threading.get_ident)
    assert seen["step"] == {model_ident} and seen["load_state_dict"] == {model_ident}
    assert model_ident != threading.get_ident()
    thread.close()  # given to the engine, not owned by it: still usable after aclose

    owned = LocalEngine(model, tok, max_batch=2, chunk_size=16)  # makes and owns its thread
    await owned.aclose()
    await owned.aclose()  # before: the second close called into the shut-down thread and raised
