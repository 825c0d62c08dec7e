"""A task whose inference actor died mid-generation: the actor that gets it next continues each single-turn
sample from the tokens already on ``rollout.tokens`` (actors/inference/resume.py), never generating them
again; over the in-memory transport, against the local server's app with the tiny model."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import anyio
import numpy as np
import pytest

from actors.inference.actor import InferenceActor
from actors.inference.resume import Frontiers, frontiers
from actors.runtime import Runtime
from engine.actor import RestartPolicy, Supervisor
from engine.config import EngineConfig, InferenceConfig, TransportConfig
from engine.schemas import Completion, Task, TokenChunk
from modelserver.llm import load_model_dir
from streams.memory import MemoryEventLog

pytestmark = pytest.mark.timeout(120)


def _chunk(sid: str, seq: int, ids: list[int], versions: list[int], *, done: str = "") -> TokenChunk:
    return TokenChunk(sample_id=sid, task_id=sid.split("/")[0], seq=seq, token_ids=np.asarray(ids, np.int32),
                      logprobs=np.asarray([-0.5 - 0.1 * i for i in range(len(ids))], np.float32),
                      weight_version=versions[-1] if versions else 0,
                      weight_versions=None if len(set(versions)) <= 1 else np.asarray(versions, np.int32),
                      done=bool(done), finish_reason=done)


def test_a_frontier_is_the_unbroken_run_of_chunks_of_the_latest_generation() -> None:
    a = [_chunk("t/0", 0, [10, 11], [0, 0]), _chunk("t/0", 1, [12], [1]),
         _chunk("t/0", 1, [12], [1]),  # a producer's retry: harmless, ignored
         _chunk("t/0", 3, [99], [1]),  # a gap: the stream is broken here
         _chunk("t/0", 2, [98], [1])]  # and nothing after the break is taken, even the seq that was next
    b = [_chunk("t/1", 0, [20], [0]), _chunk("t/1", 1, [21], [0]),
         _chunk("t/1", 0, [30, 31], [2, 2])]  # generated again from scratch: the frontier starts over
    c = [_chunk("t/2", 0, [40], [0], done="length"), _chunk("t/2", 0, [40], [0], done="length"),  # a retry
         _chunk("t/2", 1, [41], [0])]  # after done: broken
    got = frontiers(a + b + c)
    ids, lps, versions = got["t/0"].tokens()
    assert (ids, versions) == ([10, 11, 12], [0, 0, 1]) and not got["t/0"].finished
    assert (got["t/0"].broken, got["t/0"].ignored) == ("chunk 3 where 2 was next (a gap, or out of order)", 2)
    assert got["t/1"].tokens()[0] == [30, 31] and got["t/1"].chunks == 1 and not got["t/1"].broken
    assert got["t/2"].tokens()[0] == [40] and got["t/2"].finish_reason == "length"
    assert got["t/2"].broken == "chunk 1 after the done chunk 0"
    assert lps == np.asarray([-0.5, -0.6, -0.5], np.float32).tolist()


def test_out_of_order_conflicting_and_headless_streams_are_said_and_never_spliced() -> None:
    swapped = [_chunk("s/0", 0, [1], [0]), _chunk("s/0", 2, [3], [0]), _chunk("s/0", 1, [2], [0]),
               _chunk("s/0", 3, [4], [0])]
    racing = [_chunk("s/1", 0, [1], [0]), _chunk("s/1", 1, [2], [0]), _chunk("s/1", 1, [7], [0])]
    headless = [_chunk("s/2", 1, [5], [0]), _chunk("s/2", 2, [6], [0])]  # chunk 0 before the read's start
    got = frontiers(swapped + racing + headless)
    assert got["s/0"].tokens()[0] == [1] and got["s/0"].broken.startswith("chunk 2 where 1 was next")
    assert got["s/0"].ignored == 3
    assert got["s/1"].tokens()[0] == [1, 2] and "disagrees" in got["s/1"].broken
    assert got["s/2"].chunks == 0 and got["s/2"].broken == "chunk 1 with no chunk 0 before it in the read"
    assert got["s/2"].ignored == 2


@pytest.mark.anyio
async def test_a_partition_taken_over_in_a_rebalance_is_looked_up_with_what_its_last_owner_streamed() -> None:
    log = MemoryEventLog()
    await log.ensure_topics({"tokens": 2})
    producer = log.producer(producer_id="p")
    _later_than_now()
    started = time.time_ns() // 1_000_000
    fronts = Frontiers(log, "tokens", window_s=600, started_ms=started)
    _later_than_now()
    record_ms = time.time_ns() // 1_000_000  # a task produced after this actor started, first given to another
    # before any rebalance such a record was delivered to nobody else: no look-back
    assert not fronts.may_have_frontiers(record_ms, owned_since_ms=started)
    await producer.send("tokens", _chunk("early/0", 0, [1, 2], [0, 0]), key="early/0")
    assert set(await fronts.take(started - 1, ["early/0"])) == {"early/0"} and fronts.reads == 1
    # the other member streams half of "moved/0", then dies; its partition comes to this actor
    await producer.send("tokens", _chunk("moved/0", 0, [5, 6, 7], [3, 3, 3]), key="moved/0")
    _later_than_now()
    taken_over = time.time_ns() // 1_000_000
    assert fronts.may_have_frontiers(record_ms, owned_since_ms=taken_over)
    got = await fronts.take(record_ms, ["moved/0"], owned_since_ms=taken_over)
    # the read made before the takeover did not hold the dead member's chunks: read again
    assert fronts.reads == 2 and got["moved/0"].tokens()[0] == [5, 6, 7]
    # one read covers every record of the takeover
    await fronts.take(record_ms, ["other/0"], owned_since_ms=taken_over)
    assert fronts.reads == 2


def _inference(rt: Runtime, url: str, tokenizer: object, tmp_path: Path) -> Supervisor:
    sup = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
    sup.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "w"))
    return sup


async def _until(predicate: Callable[[], bool], timeout_s: float = 60) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.02)


def _completions(log: MemoryEventLog, topic: str) -> dict[str, Completion]:
    return {m.sample_id: m for m in log.messages(topic) if isinstance(m, Completion)}


def _later_than_now() -> None:
    """Let the millisecond clock pass what was just produced (record timestamps are milliseconds)."""
    mark = time.time_ns() // 1_000_000 + 1
    while time.time_ns() // 1_000_000 < mark:
        time.sleep(0.001)


@pytest.mark.anyio
async def test_the_next_actor_continues_each_sample_from_the_tokens_the_dead_one_streamed(
        tmp_path: Path, tiny_local_server: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    model_dir, url = tiny_local_server
    _, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(namespace="takeover", transport=TransportConfig(type="memory"),
                       inference=InferenceConfig(model_dir=model_dir, max_new_tokens=14, concurrency=16,
                                                 stream_interval=4))
    task = Task(task_id="t1", domain="arith", prompt="2+3=", spec={"answer": "5"}, group_size=4,
                sampling={"max_new_tokens": 14, "ignore_eos": True})
    async with Runtime(cfg, instance="one", use_nats=False) as rt:
        log = rt.event_log
        assert isinstance(log, MemoryEventLog)
        names = rt.names
        # what the dead actor left: the task (never acknowledged), sample 0 half generated across a weight
        # update, sample 1 finished, sample 2 not begun; and another task's sample, not this one's business
        await rt.producer.send(names.tasks, task, key=task.task_id)
        dead = [_chunk("t1/0", 0, [10, 11, 12, 13], [0, 0, 0, 0]), _chunk("t1/0", 1, [14, 15, 16, 17], [0, 0, 1, 1]),
                _chunk("t1/1", 0, [20, 21, 22, 23], [1, 1, 1, 1]), _chunk("t1/1", 1, [24, 2], [1, 1], done="stop"),
                _chunk("t1/0", 1, [14, 15, 16, 17], [0, 0, 1, 1]),  # re-sent by its producer
                _chunk("t1/3", 0, [40, 41, 42, 43], [1, 1, 1, 1]), _chunk("t1/3", 2, [48], [1]),  # a gap
                _chunk("other/0", 0, [30, 31], [0, 0])]
        for c in dead:
            await rt.producer.send(names.tokens, c, key=c.sample_id)
        before = {p: len(records) for p, records in enumerate(log.topics[names.tokens])}
        _later_than_now()  # the successor starts after all of it
        sup = _inference(rt, url, tokenizer, tmp_path)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            await _until(lambda: len(_completions(log, names.completions)) == 4)
            stats = sup.actors["inference"].statistics()
            sup.drain()
        new = [m for _, _, m in sorted(await log.read_since(names.tokens, before, expect=(TokenChunk.SCHEMA,)),
                                       key=lambda r: (r[0], r[1])) if isinstance(m, TokenChunk)]
    done = _completions(log, names.completions)

    # sample 0: the dead actor's 8 tokens kept exactly (ids, logprobs, per-token versions), 6 more generated
    c0 = done["t1/0"]
    assert c0.response_ids[:8].tolist() == list(range(10, 18)) and len(c0.response_ids) == 14
    assert np.allclose(c0.logprobs[:8], [-0.5, -0.6, -0.7, -0.8] * 2)
    assert c0.weight_versions[:8].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    mine = [c for c in new if c.sample_id == "t1/0"]
    assert [c.seq for c in mine] == list(range(2, 2 + len(mine))) and mine[-1].done  # numbered on, ends done
    assert [t for c in mine for t in c.token_ids.tolist()] == c0.response_ids[8:].tolist()
    # sample 1 had finished: rebuilt whole, nothing generated or streamed
    c1 = done["t1/1"]
    assert c1.response_ids.tolist() == [20, 21, 22, 23, 24, 2] and c1.finish_reason == "stop"
    assert not [c for c in new if c.sample_id == "t1/1"]
    # sample 2 had nothing on the topic: generated from scratch, from seq 0
    assert [c.seq for c in new if c.sample_id == "t1/2"][0] == 0 and len(done["t1/2"].response_ids) == 14
    # sample 3's stream had a gap after its chunk 0: continued from that chunk only, and said
    c3 = done["t1/3"]
    assert c3.response_ids[:4].tolist() == [40, 41, 42, 43] and len(c3.response_ids) == 14
    assert [c.seq for c in new if c.sample_id == "t1/3"][0] == 1
    assert (stats["samples_taken_over"], stats["tokens_taken_over"], stats["stream_breaks"]) == (3, 18, 1)
    said = [r.getMessage() for r in caplog.records if "stream" in r.getMessage() and "broken" in r.getMessage()]
    assert len(said) == 1 and "t1/3" in said[0] and "chunk 2 where 1 was next" in said[0]
    assert "continues from its first 1 chunk(s)" in said[0]


@pytest.mark.anyio
async def test_a_task_produced_after_the_actor_started_is_generated_without_a_look_back(
        tmp_path: Path, tiny_local_server: tuple[str, str]) -> None:
    model_dir, url = tiny_local_server
    _, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(namespace="fresh", transport=TransportConfig(type="memory"),
                       inference=InferenceConfig(model_dir=model_dir, max_new_tokens=6, concurrency=16))
    async with Runtime(cfg, instance="one", use_nats=False) as rt:
        log = rt.event_log
        assert isinstance(log, MemoryEventLog)
        stale = _chunk("t2/0", 0, [10, 11], [0, 0])  # a stray chunk under the same sample id
        await rt.producer.send(rt.names.tokens, stale, key=stale.sample_id)
        sup = _inference(rt, url, tokenizer, tmp_path)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            await _until(lambda: sup.actors.get("inference") is not None and sup.actors["inference"].frontiers is not None)
            _later_than_now()
            await rt.producer.send(rt.names.tasks, Task(task_id="t2", domain="arith", prompt="1+1=",
                                                        spec={"answer": "2"}, group_size=1), key="t2")
            await _until(lambda: bool(_completions(log, rt.names.completions)))
            actor = sup.actors["inference"]
            stats, reads = actor.statistics(), actor.frontiers.reads
            sup.drain()
    assert reads == 0 and stats["samples_taken_over"] == 0
