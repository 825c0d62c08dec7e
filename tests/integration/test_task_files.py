"""A user's task file through the real scheduler, broker and NATS KV: each row issued once across a restart."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from actors.runtime import Runtime
from actors.scheduler import SCHEDULER_STATUS_KEY, SchedulerActor, scheduler_status_key
from engine.config import EngineConfig, KafkaConfig, LearnerConfig, NatsConfig, SchedulerConfig
from engine.schemas import Task
from streams.kafka import Consumer

pytestmark = pytest.mark.anyio


def _cfg(kafka: str, nats: str, namespace: str, path: Path, max_tasks: int, replica: int = 0,
         replicas: int = 1) -> EngineConfig:
    return EngineConfig(
        namespace=namespace, kafka=KafkaConfig(bootstrap=kafka, default_partitions=1), nats=NatsConfig(url=nats),
        learner=LearnerConfig(batch_size=64),
        scheduler=SchedulerConfig(task_files={str(path): 1.0}, group_size=1, max_tasks=max_tasks, replica=replica,
                                  replicas=replicas))


async def _issued(cfg: EngineConfig, topic: str, n: int) -> list[Task]:
    """The tasks on ``topic`` (one partition): exactly ``n`` of them, nothing beyond."""
    tasks: list[Task] = []
    async with Consumer(cfg.kafka, assign=[(topic, 0)], expect=(Task.SCHEMA,)) as out:
        with anyio.fail_after(30):
            while len(tasks) < n:
                tasks.extend(r.message for r in await out.getmany(timeout_s=0.2))
        assert not await out.getmany(timeout_s=1.0)  # nothing beyond them
    return tasks


async def test_task_file_rows_issued_once_across_a_restart(
        kafka_bootstrap: str, nats_url: str, unique_name: str, tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    rows = [{"id": f"q{i}", "domain": "math", "prompt": f"What is {i} + 1? Answer with just the number.",
             "answer": str(i + 1)} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    first_cfg = _cfg(kafka_bootstrap, nats_url, unique_name, path, max_tasks=4)
    async with Runtime(first_cfg) as rt:
        with anyio.fail_after(30):
            await SchedulerActor(rt).run()  # stops after max_tasks=4
        saved = json.loads(await rt.require_control().kv_get(rt.names.bucket(first_cfg.nats.kv_bucket),
                                                          SCHEDULER_STATUS_KEY) or b"{}")
        assert saved["source_positions"] == {"file:mine.jsonl": 4}

    again_cfg = _cfg(kafka_bootstrap, nats_url, unique_name, path, max_tasks=100)
    async with Runtime(again_cfg) as rt:
        actor = SchedulerActor(rt)
        with anyio.fail_after(30):
            await actor.run()  # resumes at row 5 and stops when the file is exhausted
        assert actor.done and actor.tasks_admitted == 6
        tasks = await _issued(again_cfg, rt.names.tasks, 6)
    assert [t.spec["task_file_id"] for t in tasks] == [f"q{i}" for i in range(6)]
    assert all(t.domain == "math" and t.spec["answer"] == str(int(t.spec["task_file_id"][1:]) + 1) for t in tasks)


async def test_rows_issued_after_the_last_status_are_not_issued_again(
        kafka_bootstrap: str, nats_url: str, unique_name: str, tmp_path: Path) -> None:
    """A scheduler killed between publishing tasks and writing its status: its successor reads the tasks
    topic from the offsets of the last status and issues neither those rows again nor skips any."""
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "domain": "math", "prompt": f"What is {i} + 2?",
                                        "answer": str(i + 2)}) + "\n" for i in range(6)))
    first_cfg = _cfg(kafka_bootstrap, nats_url, unique_name, path, max_tasks=4)
    async with Runtime(first_cfg) as rt:
        with anyio.fail_after(30):
            await SchedulerActor(rt).run()
        bucket, store = rt.names.bucket(first_cfg.nats.kv_bucket), rt.require_control()
        saved = json.loads(await store.kv_get(bucket, SCHEDULER_STATUS_KEY) or b"{}")
        assert saved["tasks_offsets"] == {"0": 4}
        # the status as it was after the first task: three rows issued since were never recorded
        stale = dict(saved, tasks_admitted=1, admitted_samples=1, source_positions={"file:mine.jsonl": 1},
                     tasks_offsets={"0": 1})
        await store.kv_put(bucket, SCHEDULER_STATUS_KEY, json.dumps(stale).encode())

    again_cfg = _cfg(kafka_bootstrap, nats_url, unique_name, path, max_tasks=100)
    async with Runtime(again_cfg) as rt:
        actor = SchedulerActor(rt)
        with anyio.fail_after(30):
            await actor.run()
        assert actor.done and actor.tasks_admitted == 6 and actor.admitted_samples == 6
        tasks = await _issued(again_cfg, rt.names.tasks, 6)
    assert [t.spec["task_file_id"] for t in tasks] == [f"q{i}" for i in range(6)]  # once each, in order


async def test_replicas_keep_their_own_positions_across_a_restart(
        kafka_bootstrap: str, nats_url: str, unique_name: str, tmp_path: Path) -> None:
    """Two scheduler replicas share a task file (rows 0, 2, 4 and 1, 3, 5): each stores its own position,
    so after both restart every row has been issued once (one shared status had replica 0 resume at
    replica 1's position and skip a row)."""
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "domain": "math", "prompt": f"What is {i} + 3?",
                                        "answer": str(i + 3)}) + "\n" for i in range(6)))
    for replica, max_tasks in ((0, 1), (1, 2)):
        async with Runtime(_cfg(kafka_bootstrap, nats_url, unique_name, path, max_tasks, replica, 2)) as rt:
            with anyio.fail_after(30):
                await SchedulerActor(rt).run()
    cfg = _cfg(kafka_bootstrap, nats_url, unique_name, path, 100)
    async with Runtime(cfg) as rt:
        bucket, store = rt.names.bucket(cfg.nats.kv_bucket), rt.require_control()
        positions = [json.loads(await store.kv_get(bucket, scheduler_status_key(r)) or b"{}")["source_positions"]
                     for r in (0, 1)]
        assert positions == [{"file:shared.jsonl": 1}, {"file:shared.jsonl": 2}]
    for replica in (0, 1):
        async with Runtime(_cfg(kafka_bootstrap, nats_url, unique_name, path, 100, replica, 2)) as rt:
            actor = SchedulerActor(rt)
            with anyio.fail_after(30):
                await actor.run()
            assert actor.done and actor.tasks_admitted == 3
    tasks = await _issued(cfg, rt.names.tasks, 6)
    assert sorted(t.spec["task_file_id"] for t in tasks) == [f"q{i}" for i in range(6)]  # each once


def _generator_cfg(kafka: str, nats: str, namespace: str, max_tasks: int, replica: int = 0,
                   replicas: int = 1) -> EngineConfig:
    return EngineConfig(
        namespace=namespace, kafka=KafkaConfig(bootstrap=kafka, default_partitions=1), nats=NatsConfig(url=nats),
        learner=LearnerConfig(batch_size=64),
        scheduler=SchedulerConfig(domains={"math": 1.0, "docqa": 1.0}, group_size=1, max_tasks=max_tasks,
                                  replica=replica, replicas=replicas))


def _draws(tasks: list[Task]) -> list[tuple[str, str]]:
    return [(t.domain, t.spec["generator_draw"]) for t in tasks]


async def test_a_restarted_scheduler_goes_on_drawing_and_never_draws_a_task_again(
        kafka_bootstrap: str, nats_url: str, unique_name: str) -> None:
    """The domains' generators through a restart: the second scheduler continues each generator where the
    first stopped (the draws of one uninterrupted scheduler, each once), instead of drawing the same
    prompts again from the seed; so do draws published after the last status (read back from the topic)."""
    whole = f"{unique_name}-whole"
    async with Runtime(_generator_cfg(kafka_bootstrap, nats_url, whole, max_tasks=12)) as rt:
        with anyio.fail_after(30):
            await SchedulerActor(rt).run()
        uninterrupted = await _issued(rt.cfg, rt.names.tasks, 12)

    async with Runtime(_generator_cfg(kafka_bootstrap, nats_url, unique_name, max_tasks=8)) as rt:
        with anyio.fail_after(30):
            await SchedulerActor(rt).run()
        bucket, store = rt.names.bucket(rt.cfg.nats.kv_bucket), rt.require_control()
        saved = json.loads(await store.kv_get(bucket, SCHEDULER_STATUS_KEY) or b"{}")
        assert sum(saved["source_positions"].values()) == 8
        # the status as it was after 5 tasks: the last three draws were published but never recorded
        first_five = await _issued(rt.cfg, rt.names.tasks, 8)
        positions = {d: sum(1 for t in first_five[:5] if t.domain == d) for d in ("math", "docqa")}
        stale = dict(saved, tasks_admitted=5, admitted_samples=5, source_positions=positions, tasks_offsets={"0": 5})
        await store.kv_put(bucket, SCHEDULER_STATUS_KEY, json.dumps(stale).encode())

    async with Runtime(_generator_cfg(kafka_bootstrap, nats_url, unique_name, max_tasks=12)) as rt:
        actor = SchedulerActor(rt)
        with anyio.fail_after(30):
            await actor.run()
        assert actor.tasks_admitted == 12 and actor.admitted_samples == 12
        resumed = await _issued(rt.cfg, rt.names.tasks, 12)
    assert len(set(_draws(resumed))) == 12  # no draw twice
    assert len({(t.domain, t.prompt) for t in resumed}) == len({(t.domain, t.prompt) for t in uninterrupted})
    by_draw = {(t.domain, t.spec["generator_draw"]): t.prompt for t in uninterrupted}
    assert all(by_draw.get(key, prompt) == prompt for key, prompt in zip(_draws(resumed), (t.prompt for t in resumed)))


async def test_scheduler_replicas_draw_different_tasks() -> None:
    from actors.scheduler import GeneratorSource
    from domains import DOMAINS

    one, two = GeneratorSource(DOMAINS["math"], seed=3, replica=0), GeneratorSource(DOMAINS["math"], seed=3, replica=1)
    first = [one.next(0.0) for _ in range(8)]
    second = [two.next(0.0) for _ in range(8)]
    assert [t.prompt for t in first] != [t.prompt for t in second]
    assert {t.spec["generator_draw"] for t in first}.isdisjoint({t.spec["generator_draw"] for t in second})
