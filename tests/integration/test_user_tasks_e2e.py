"""A user's own tasks end to end on the real broker, nats-server and bubblewrap sandboxes: the rows of a JSONL
file the user wrote are trained on by a short deployment (char-model fixture, two learner steps), the
trained model is evaluated on them with `rollout eval`, and the experience is exported (full rows and the
SFT view); the exported files load with ``datasets.load_dataset("json", ...)`` and match what was trained."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from transformers import AutoTokenizer

from actors.export import ExportFilter, SftView, export_jsonl
from actors.learner import LearnerActor
from learning.core import StepReport
from engine.config import (EngineConfig, EvalConfig, InferenceConfig, KafkaConfig, LearnerConfig, NatsConfig,
                           RewardConfig, SandboxConfig, SchedulerConfig)
from engine.schemas import EvalResult, Experience, Task
from ops.cli import main
from ops.deployment import Deployment
from streams.kafka import Consumer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

ROWS = 6
GROUP = 2


def _user_file(path: Path) -> dict[str, dict[str, str]]:
    rows = {f"sum-{i}": {"id": f"sum-{i}", "domain": "math", "prompt": f"{i}+{i + 2}=", "answer": str(2 * i + 2)}
            for i in range(ROWS)}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    return rows


def _evaluated(d: Deployment) -> int:
    """Weight versions after v0 the deployment's eval actor has evaluated."""
    actor = d.supervisor.actors.get("eval")
    last = actor.statistics()["last_version"] if actor is not None else None
    return 0 if last is None else last


async def _read(cfg: EngineConfig, topic: str, schema: str, n: int) -> list[object]:
    out: list[object] = []
    async with Consumer(cfg.kafka, assign_topics=[topic], expect=(schema,)) as consumer:
        with anyio.fail_after(30):
            while len(out) < n:
                out.extend(r.message for r in await consumer.getmany(timeout_s=0.5))
    return out


async def test_user_tasks_are_trained_evaluated_and_exported(
        kafka_bootstrap: str, nats_url: str, unique_name: str, tmp_path: Path) -> None:
    tasks_file = tmp_path / "mine.jsonl"
    rows = _user_file(tasks_file)
    trained_dir = tmp_path / "trained"
    cfg = EngineConfig(
        namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
        nats=NatsConfig(url=nats_url), roles=["scheduler", "inference", "sandbox", "reward"],
        learner=LearnerConfig(batch_size=4, max_steps=2, checkpoint_dir=str(tmp_path / "ckpt"),
                              export_dir=str(trained_dir)),
        scheduler=SchedulerConfig(group_size=GROUP, task_files={str(tasks_file): 1.0}),
        inference=InferenceConfig(max_new_tokens=6),
        sandbox=SandboxConfig(pool_size=1, max_sandboxes=4),
        # the char model scores every sample of a group alike: keep those groups, or the learner never steps
        reward=RewardConfig(drop_zero_variance=False, group_timeout_s=60),
        # evaluation during training: the file's rows, on the first served version and every version after
        eval=EvalConfig(every_versions=1, task_file=str(tasks_file), temperature=1.0, max_new_tokens=6))

    # -- train: the deployment's own roles, the learner with a hook that records each step's samples
    reports: list[StepReport] = []
    d = Deployment(cfg, run_dir=tmp_path / "run", extra_actors=[
        ("learner", lambda: LearnerActor(d.rt, model_dir=str(d.model_dir), on_step=reports.append))])
    async with d:
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.run)
            with anyio.fail_after(150):
                while len(reports) < 2 or not (trained_dir / "config.json").exists() or _evaluated(d) < 1:
                    await anyio.sleep(0.2)
            d.drain()
    trained = {sid for r in reports for sid in r.trained}
    assert len(trained) == 8  # two steps of batch_size 4

    # every issued task is a row of the user's file, once
    issued = await _read(cfg, d.rt.names.tasks, Task.SCHEMA, ROWS)
    by_task = {t.task_id: t.spec["task_file_id"] for t in issued if isinstance(t, Task)}
    assert sorted(by_task.values()) == sorted(rows)
    experience = [e for e in await _read(cfg, d.rt.names.experience, Experience.SCHEMA, len(trained))
                  if isinstance(e, Experience)]

    # -- the eval actor evaluated versions while training, on its own topic: v0 first, then a trained one
    evals = [e for e in await _read(cfg, d.rt.names.eval, EvalResult.SCHEMA, 2) if isinstance(e, EvalResult)]
    assert evals[0].weight_version == 0 and evals[1].weight_version >= 1
    assert {e.domain for e in evals} == {"math"} and all(e.tasks == ROWS and e.samples == 1 for e in evals)
    assert all(e.completion_ci95[0] <= e.completion_rate <= e.completion_ci95[1] for e in evals)

    # -- evaluate the trained model on the same file with `rollout eval` (its own event loop: a worker thread)
    report = tmp_path / "eval.json"
    argv = ["eval", "--model-dir", str(trained_dir), "--tasks", str(tasks_file), "--samples", "2",
            "--temperature", "1.0", "--json", str(report), "--markdown", str(tmp_path / "eval.md")]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    result = json.loads(report.read_text())
    math = result["domains"]["math"]
    assert (math["tasks"], math["samples"], math["episodes"]) == (ROWS, 2, 2 * ROWS)
    assert sorted({e["task_id"] for e in result["episodes"]}) == sorted(rows)
    assert math["solved"] == sum(e["correctness"] >= 1.0 for e in result["episodes"])
    lo, hi = math["completion_ci95"]
    assert lo <= math["completion_rate"] <= hi and 0.0 <= math["pass_at_1"] <= math["pass_at_k"] <= 1.0
    assert math["mean_turns"] == 1.0 and 0 < math["mean_tokens"] <= 8  # math's budget: 8 tokens
    assert "| math | 6 | 2 |" in (tmp_path / "eval.md").read_text()
    # the learner's final checkpoint is a policy too: `--checkpoint` serves the newest of the directory
    ckpt_report = tmp_path / "eval-ckpt.json"
    argv = ["eval", "--checkpoint", str(tmp_path / "ckpt" / unique_name), "--tasks", str(tasks_file),
            "--json", str(ckpt_report)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    from_ckpt = json.loads(ckpt_report.read_text())
    assert from_ckpt["domains"]["math"]["episodes"] == ROWS and from_ckpt["temperature"] == 0.0

    # -- export: full rows and the SFT view, loaded back with datasets
    import datasets

    out = tmp_path / "traj.jsonl"
    read, written = await export_jsonl(cfg.kafka, d.rt.names.experience, out, ExportFilter(), idle_s=2.0)
    assert read == written >= len(trained)
    ds = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    exported = dict(zip(ds["sample_id"], zip(ds["task_id"], ds["reward"], ds["advantage"], strict=True), strict=True))
    assert trained <= set(exported)  # every trained sample is in the file ...
    for e in experience:  # ... with the reward and advantage the learner read from the log
        assert exported[e.sample_id] == (e.task_id, pytest.approx(e.reward), pytest.approx(e.advantage))
    assert {by_task[task_id] for task_id, _, _ in exported.values()} <= set(rows)

    tokenizer = AutoTokenizer.from_pretrained(str(trained_dir))
    sft_out = tmp_path / "sft.jsonl"
    # the random char model rarely solves a sum: take every trajectory (min reward below any) to see the shape
    await export_jsonl(cfg.kafka, d.rt.names.experience, sft_out, ExportFilter(), idle_s=2.0,
                       sft=SftView(tokenizer, min_reward=-1e9))
    sft = datasets.load_dataset("json", data_files=str(sft_out), split="train", cache_dir=str(tmp_path / "hf2"))
    assert len(sft) == written
    prompts = {r["prompt"] for r in rows.values()}
    for messages in sft["messages"]:
        assert messages[0]["role"] == "user" and messages[0]["content"] in prompts
        assert [m["role"] for m in messages[1:]] == ["assistant"]
    # the default SFT view keeps the solved ones only
    solved = tmp_path / "solved.jsonl"
    _, kept = await export_jsonl(cfg.kafka, d.rt.names.experience, solved, ExportFilter(), idle_s=2.0,
                                 sft=SftView(tokenizer))
    assert kept == sum(json.loads(f)["reward_terms"]["correctness"] >= 1.0 for f in ds["facts"])

