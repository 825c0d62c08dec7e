"""The inference actor end to end: tasks from Kafka, token chunks and completions out, a weight
version published through NATS picked up mid-run (real broker, nats-server and local server)."""

from collections import defaultdict

import anyio
import numpy as np
import pytest
import torch

from actors.inference.actor import InferenceActor
from modelserver.launch import LocalServer
from modelserver.llm import load_model_dir, save_model_dir, write_tiny_model_dir
from actors.runtime import Runtime
from engine.actor import RestartPolicy, Supervisor
from engine.config import EngineConfig, InferenceConfig, KafkaConfig, NatsConfig, SchedulerConfig
from engine.schemas import Completion, Task, TokenChunk
from streams.kafka import Consumer
from streams.weights import WeightPublisher

pytestmark = pytest.mark.anyio

TASKS, GROUP, TOKENS = 6, 4, 160


def _perturbed_copy(model_dir, out_dir) -> list:
    model, tokenizer = load_model_dir(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_model_dir(model, tokenizer, out_dir)  # a whole HF directory, as the learner publishes
    return sorted(p for p in out_dir.iterdir() if p.is_file())


def _traceparent(i: int) -> str:
    return f"00-{i + 1:032x}-{i + 1:016x}-01"


@pytest.mark.parametrize("stream_interval", [1, 16])
async def test_tasks_in_chunks_and_completions_out_with_a_weight_update_mid_run(
        kafka_bootstrap, nats_url, unique_name, tmp_path, stream_interval):
    model_dir = write_tiny_model_dir(tmp_path / "model", seed=0)
    _, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=2),
                       nats=NatsConfig(url=nats_url), scheduler=SchedulerConfig(group_size=GROUP),
                       inference=InferenceConfig(concurrency=TASKS * GROUP, temperature=1.0,
                                                 stream_interval=stream_interval))
    # 4 generations at a time: the 24 run in waves, so the update lands mid-run however fast one wave decodes
    async with LocalServer(model_dir, log_path=tmp_path / "server.log", max_batch=4) as url, Runtime(cfg) as rt:
        names = rt.names
        for i in range(TASKS):
            await rt.producer.send(names.tasks, Task(
                task_id=f"t{i}", domain="arith", prompt=f"{i}+{i}=", spec={"answer": str(2 * i)}, group_size=GROUP,
                sampling={"max_new_tokens": TOKENS, "ignore_eos": True}), key=f"t{i}",
                headers={"traceparent": _traceparent(i)})
        sup = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
        sup.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "w"))
        # version 1 is made before generation starts: publishing it mid-run must be quick, or the
        # generations could all finish before the update lands
        v1_files = _perturbed_copy(model_dir, tmp_path / "v1")
        completions: dict[str, Completion] = {}
        chunks: dict[str, list[TokenChunk]] = defaultdict(list)
        chunk_traceparents: dict[tuple[str, int], str | None] = {}
        watch = Consumer(cfg.kafka, topics=[names.completions, names.tokens], group=f"{unique_name}.watch",
                         expect=("completion", "token_chunk"))
        async with watch, anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            published = False

            def chunked(sid: str) -> int:
                return sum(len(ch.token_ids) for ch in chunks[sid])

            # chunks and completions are different topics: a sample's last chunk may be read after
            # its completion, so read until every completion's tokens have all come as chunks too
            with anyio.fail_after(240):
                while len(completions) < TASKS * GROUP or any(
                        chunked(sid) < len(c.response_ids) for sid, c in completions.items()):
                    for r in await watch.getmany(timeout_s=0.2):
                        m = r.message
                        if isinstance(m, TokenChunk):
                            chunks[m.sample_id].append(m)
                            chunk_traceparents[m.sample_id, m.seq] = r.traceparent
                        else:
                            completions[m.sample_id] = m
                        r.ack()
                    if not published and chunks:
                        # generation is under way: publish version 1 through NATS
                        await WeightPublisher(rt.require_control(), names).publish(1, v1_files)
                        published = True
            actor = sup.actors["inference"]
            stats = actor.statistics()
            sup.drain()
    assert stats["weight_version"] == 1
    versions_seen = set()
    for sid, c in completions.items():
        n = len(c.response_ids)
        assert 0 < n <= TOKENS
        assert c.loss_mask.tolist() == [1] * n
        assert (c.logprobs <= 0).all() and np.isfinite(c.logprobs).all()
        # the streamed chunks, in order, are exactly the completion's tokens (never re-tokenised)
        ordered = sorted(chunks[sid], key=lambda ch: ch.seq)
        assert [ch.seq for ch in ordered] == list(range(len(ordered)))
        assert np.concatenate([ch.token_ids for ch in ordered]).tolist() == c.response_ids.tolist()
        # a record carries stream_interval tokens or more, except the last of each generate call (its
        # end, or an abort by a weight update that the sample then resumed)
        short = [len(ch.token_ids) for ch in ordered if len(ch.token_ids) < stream_interval]
        assert len(short) <= 1 + stats["resumed"], (sid, [len(ch.token_ids) for ch in ordered])
        if stream_interval > 1:
            assert len(ordered) <= n // stream_interval + 1 + stats["resumed"]
        # tracing is off here, so the sample's context is its task's: on its first chunk only
        task_tp = _traceparent(int(c.task_id[1:]))
        assert [chunk_traceparents[sid, ch.seq] for ch in ordered] == [task_tp] + [None] * (len(ordered) - 1)
        assert set(c.weight_versions.tolist()) <= {0, 1}
        # versions never go backwards within a sample
        assert (np.diff(c.weight_versions) >= 0).all()
        versions_seen |= set(c.weight_versions.tolist())
    assert versions_seen == {0, 1}
    # at least one generation spanned the update: its tokens were kept and tagged with both versions
    assert any(len(set(c.weight_versions.tolist())) == 2 for c in completions.values())
    assert stats["resumed"] >= 1


async def test_a_task_admitted_at_a_newer_version_waits_for_those_weights(
        kafka_bootstrap, nats_url, unique_name, tmp_path):
    model_dir = write_tiny_model_dir(tmp_path / "model", seed=0)
    _, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       nats=NatsConfig(url=nats_url), scheduler=SchedulerConfig(group_size=2),
                       inference=InferenceConfig(concurrency=8, temperature=1.0))
    async with LocalServer(model_dir, log_path=tmp_path / "server.log") as url, Runtime(cfg) as rt:
        names = rt.names
        for task_id, version in (("now", 0), ("next", 1)):  # "next" was admitted after the learner's step 1
            await rt.producer.send(names.tasks, Task(
                task_id=task_id, domain="arith", prompt="1+2=", spec={"answer": "3"}, group_size=2,
                sampling={"max_new_tokens": 32, "ignore_eos": True}, admitted_version=version), key=task_id)
        sup = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
        sup.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "w"))
        completions: dict[str, Completion] = {}
        chunks: dict[str, int] = defaultdict(int)
        watch = Consumer(cfg.kafka, topics=[names.completions, names.tokens], group=f"{unique_name}.watch",
                         expect=("completion", "token_chunk"))
        async with watch, anyio.create_task_group() as tg:
            tg.start_soon(sup.run)

            async def until(n: int) -> None:
                with anyio.fail_after(120):
                    while len(completions) < n:
                        for r in await watch.getmany(timeout_s=0.2):
                            m = r.message
                            if isinstance(m, TokenChunk):
                                chunks[m.task_id] += 1
                            else:
                                completions[m.sample_id] = m
                            r.ack()

            await until(2)  # the version-0 task is done; the version-1 task has been held all along
            assert set(completions) == {"now/0", "now/1"} and chunks["next"] == 0
            await WeightPublisher(rt.require_control(), names).publish(1, _perturbed_copy(model_dir, tmp_path / "v1"))
            await until(4)
            sup.drain()
    held = [completions["next/0"], completions["next/1"]]
    assert all(set(c.weight_versions.tolist()) == {1} for c in held)  # not one token from the old weights
    assert all(set(completions[f"now/{i}"].weight_versions.tolist()) == {0} for i in range(2))


async def test_a_draining_actor_gives_back_a_task_still_waiting_for_weights(
        kafka_bootstrap, nats_url, unique_name, tmp_path):
    """Draining does not wait for weights that may never come: the held task goes back unacknowledged
    and the next actor of the group generates it, with the weights it was admitted for."""
    model_dir = write_tiny_model_dir(tmp_path / "model", seed=0)
    _, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       nats=NatsConfig(url=nats_url), scheduler=SchedulerConfig(group_size=2),
                       inference=InferenceConfig(concurrency=8, temperature=1.0, weight_sync_timeout_s=3600))
    async with LocalServer(model_dir, log_path=tmp_path / "server.log") as url, Runtime(cfg) as rt:
        names = rt.names
        for task_id, version in (("now", 0), ("next", 1)):
            await rt.producer.send(names.tasks, Task(
                task_id=task_id, domain="arith", prompt="1+2=", spec={"answer": "3"}, group_size=2,
                sampling={"max_new_tokens": 8, "ignore_eos": True}, admitted_version=version), key=task_id)
        completions: dict[str, Completion] = {}
        watch = Consumer(cfg.kafka, topics=[names.completions], group=f"{unique_name}.watch", expect=("completion",))

        async def until(n: int) -> None:
            with anyio.fail_after(120):
                while len(completions) < n:
                    for r in await watch.getmany(timeout_s=0.2):
                        completions[r.message.sample_id] = r.message
                        r.ack()

        async with watch:
            # a drain timeout far beyond the test's deadline: only giving the task back ends this drain
            first = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=3600)
            first.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "w1"))
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(first.run)
                    await until(2)  # "now" done; "next" held for version 1, which nobody publishes
                    stats = first.actors["inference"].statistics()
                    first.drain()
            assert stats["handled"] == 1 and set(completions) == {"now/0", "now/1"}
            assert first.actors["inference"].statistics()["released"] == 1

            await WeightPublisher(rt.require_control(), names).publish(1, _perturbed_copy(model_dir, tmp_path / "v1"))
            second = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
            second.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "w2"))
            async with anyio.create_task_group() as tg:
                tg.start_soon(second.run)
                await until(4)
                second.drain()
    assert all(set(completions[f"next/{i}"].weight_versions.tolist()) == {1} for i in range(2))


async def test_without_partial_rollouts_an_update_waits_for_the_generations_in_flight(
        kafka_bootstrap, nats_url, unique_name, tmp_path):
    """``inference.partial_rollouts = false``: a version published mid-run is applied only between
    generations: no sample mixes versions, none is resumed, and later samples run on the new weights."""
    model_dir = write_tiny_model_dir(tmp_path / "model", seed=0)
    _, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       nats=NatsConfig(url=nats_url), scheduler=SchedulerConfig(group_size=GROUP),
                       inference=InferenceConfig(concurrency=GROUP, temperature=1.0, stream_interval=16,
                                                 partial_rollouts=False))
    async with LocalServer(model_dir, log_path=tmp_path / "server.log", max_batch=4) as url, Runtime(cfg) as rt:
        names = rt.names
        for i in range(TASKS):
            await rt.producer.send(names.tasks, Task(
                task_id=f"t{i}", domain="arith", prompt=f"{i}+{i}=", spec={"answer": str(2 * i)}, group_size=GROUP,
                sampling={"max_new_tokens": TOKENS, "ignore_eos": True}), key=f"t{i}")
        sup = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
        sup.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "w"))
        v1_files = _perturbed_copy(model_dir, tmp_path / "v1")
        completions: dict[str, Completion] = {}
        watch = Consumer(cfg.kafka, topics=[names.completions, names.tokens], group=f"{unique_name}.watch",
                         expect=("completion", "token_chunk"))
        async with watch, anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            published = False
            with anyio.fail_after(240):
                while len(completions) < TASKS * GROUP:
                    for r in await watch.getmany(timeout_s=0.2):
                        if isinstance(r.message, Completion):
                            completions[r.message.sample_id] = r.message
                        elif not published:  # the first tokens: generation is under way
                            await WeightPublisher(rt.require_control(), names).publish(1, v1_files)
                            published = True
                        r.ack()
            stats = sup.actors["inference"].statistics()
            sup.drain()
    assert stats["weight_version"] == 1 and stats["resumed"] == 0
    versions = [set(c.weight_versions.tolist()) for c in completions.values()]
    assert all(len(v) == 1 for v in versions)  # one version per generation: never interrupted
    assert {0} in versions and {1} in versions  # the update landed between generations
    assert all(len(c.response_ids) == TOKENS for c in completions.values())  # none cut short by an abort
