"""`rollout tasks publish` on the real broker: tasks reach ``rollout.tasks.published``, ids already there are
refused by name, and a scheduler with ``published_tasks`` issues each published task once (across a restart)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from domains import DOMAINS
from actors.runtime import Runtime
from actors.scheduler import SchedulerActor
from engine.config import EngineConfig, KafkaConfig, LearnerConfig, NatsConfig, SchedulerConfig
from engine.schemas import Task
from engine.tasks import TaskFile
from ops.cli import main
from ops.cli_tasks import publish_tasks
from streams.kafka import Consumer

pytestmark = pytest.mark.anyio


def _cfg(kafka: str, nats: str, namespace: str, max_tasks: int) -> EngineConfig:
    return EngineConfig(
        namespace=namespace, kafka=KafkaConfig(bootstrap=kafka, default_partitions=2), nats=NatsConfig(url=nats),
        learner=LearnerConfig(batch_size=64),
        scheduler=SchedulerConfig(domains={}, published_tasks=True, group_size=1, max_tasks=max_tasks))


def _write(path: Path, ids: range) -> TaskFile:
    path.write_text("".join(json.dumps({"id": f"q{i}", "domain": "math", "answer": str(i + 1),
                                        "prompt": f"What is {i} + 1? Answer with just the number."}) + "\n"
                            for i in ids))
    return TaskFile(path, known_domains=DOMAINS)


async def _issued(cfg: EngineConfig, topic: str, n: int) -> list[Task]:
    tasks: list[Task] = []
    async with Consumer(cfg.kafka, assign_topics=[topic], expect=(Task.SCHEMA,)) as out:
        with anyio.fail_after(30):
            while len(tasks) < n:
                tasks.extend(r.message for r in await out.getmany(timeout_s=0.2))
        assert not await out.getmany(timeout_s=1.0)  # nothing beyond
    return tasks


async def test_publish_refuses_duplicates_and_the_scheduler_issues_each_once(
        kafka_bootstrap: str, nats_url: str, unique_name: str, tmp_path: Path) -> None:
    cfg = _cfg(kafka_bootstrap, nats_url, unique_name, max_tasks=3)
    first = _write(tmp_path / "first.jsonl", range(4))
    assert await publish_tasks(cfg, first.tasks, idle_s=1.0) == (4, [], f"{unique_name}.rollout.tasks.published")
    # a second file sharing two ids: refused by name, nothing published; then the new ones only
    second = _write(tmp_path / "second.jsonl", range(2, 6))
    assert (await publish_tasks(cfg, second.tasks, idle_s=1.0))[:2] == (0, ["q2", "q3"])
    assert (await publish_tasks(cfg, second.tasks, skip_published=True, idle_s=1.0))[:2] == (2, ["q2", "q3"])

    async with Runtime(cfg) as rt:
        with anyio.fail_after(60):
            await SchedulerActor(rt).run()  # stops after max_tasks=3
    again = _cfg(kafka_bootstrap, nats_url, unique_name, max_tasks=6)
    async with Runtime(again) as rt:
        actor = SchedulerActor(rt)
        with anyio.fail_after(60):
            await actor.run()  # the restarted scheduler continues after the committed records
        assert actor.tasks_admitted == 6 and actor.published_issued == 3
        tasks = await _issued(again, rt.names.tasks, 6)
    assert sorted(t.spec["task_file_id"] for t in tasks) == [f"q{i}" for i in range(6)]
    assert all(t.domain == "math" and t.spec["answer"] == str(int(t.spec["task_file_id"][1:]) + 1) for t in tasks)


def test_publish_cli_reports_and_refuses_by_name(kafka_bootstrap: str, nats_url: str, unique_name: str,
                                                 tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "rollout.toml"
    config.write_text(f'namespace = "{unique_name}"\n[kafka]\nbootstrap = "{kafka_bootstrap}"\n'
                      f'[nats]\nurl = "{nats_url}"\n')
    path = tmp_path / "mine.jsonl"
    _write(path, range(3))
    assert main(["tasks", "publish", str(path), "--config", str(config), "--idle-s", "1"]) == 0
    assert f"{path}: 3 tasks published to {unique_name}.rollout.tasks.published" in capsys.readouterr().out
    assert main(["tasks", "publish", str(path), "--config", str(config), "--idle-s", "1"]) == 1
    err = capsys.readouterr().err
    assert "refused: 3 task id(s) already published" in err and "q0, q1, q2" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "domain": "math", "prompt": "?"}\n')
    assert main(["tasks", "publish", str(bad), "--config", str(config)]) == 1
    assert f"{bad}:1: field 'answer' is missing" in capsys.readouterr().err
