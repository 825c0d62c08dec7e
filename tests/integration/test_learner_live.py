"""The learner against the real Kafka broker and nats-server: staleness, crash/resume accounting, weights."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.learner import LearnerActor
from learning.core import StepReport
from modelserver.llm import load_model_dir, write_tiny_model_dir
from actors.runtime import Runtime
from engine.config import EngineConfig, KafkaConfig, LearnerConfig, NatsConfig, SchedulerConfig
from engine.schemas import Experience
from engine.topics import Names
from streams.weights import WeightPublisher, WeightSubscriber, check_hf_dir

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 3


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    return str(write_tiny_model_dir(tmp_path / "model", hidden_size=32, intermediate_size=64, num_layers=1,
                                    num_heads=2, num_kv_heads=1))


def make_cfg(kafka_bootstrap: str, nats_url: str, namespace: str, tmp_path: Path, *, max_staleness: int,
             **learner: object) -> EngineConfig:
    return EngineConfig(
        namespace=namespace,
        kafka=KafkaConfig(bootstrap=kafka_bootstrap, partitions={"experience": PARTITIONS}),
        nats=NatsConfig(url=nats_url, timeout_s=20),
        scheduler=SchedulerConfig(max_staleness=max_staleness),
        learner=LearnerConfig(**{"batch_size": 4, "lr": 1e-3, "checkpoint_dir": str(tmp_path / "ckpt"),
                                 "checkpoint_every": 100, **learner}),
    )


def experience(sid: str, versions: list[int], *, filtered: str = "") -> Experience:
    rng = np.random.default_rng(zlib.crc32(sid.encode()))
    n = len(versions)
    return Experience(
        sample_id=sid, task_id=f"task-{sid}", domain="arith",
        prompt_ids=rng.integers(4, 90, size=3).astype(np.int32),
        response_ids=rng.integers(4, 90, size=n).astype(np.int32),
        logprobs=np.full(n, -4.0, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
        weight_versions=np.asarray(versions, dtype=np.int32), reward=1.0, advantage=1.0, group_size=4,
        filtered=filtered)


async def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.02)


def report_json(r: StepReport) -> str:
    return json.dumps({"step": r.step, "version": r.version, "trained": r.trained, "filtered": r.filtered,
                       "dropped_stale": r.dropped_stale, "duplicates": r.duplicates})


# -- (a) staleness ------------------------------------------------------------------------------------

async def test_no_sample_beyond_the_staleness_bound_reaches_an_optimizer_step(
        kafka_bootstrap, nats_url, unique_name, tmp_path, model_dir):
    cfg = make_cfg(kafka_bootstrap, nats_url, unique_name, tmp_path, max_staleness=1, publish_every=1)
    reports: list[StepReport] = []
    min_version: dict[str, int] = {}
    async with Runtime(cfg) as rt:
        actor = LearnerActor(rt, model_dir, on_step=reports.append)
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            for r in range(5):
                # one step per round, so the learner is at version r while this round's samples arrive
                await wait_until(lambda r=r: len(reports) == r, 60, f"step {r}")
                batch = [experience(f"r{r}-fresh{i}", [r] * 5) for i in range(3)]
                batch.append(experience(f"r{r}-bound", [max(0, r - 1)] * 5))  # staleness 1: trainable
                if r >= 2:
                    batch.append(experience(f"r{r}-old", [r - 2] * 5))
                    batch.append(experience(f"r{r}-spans", [r, r, r - 2, r, r]))  # one old token is enough
                for exp in batch:
                    min_version[exp.sample_id] = exp.min_version()
                    await rt.producer.send(rt.names.experience, exp, key=exp.task_id)
            await wait_until(lambda: len(reports) == 5, 60, "step 5")
            actor.request_drain()
        stats = actor.statistics()

    stale_ids = {sid for sid in min_version if sid.endswith(("-old", "-spans"))}
    trained = [sid for rep in reports for sid in rep.trained]
    assert [rep.version for rep in reports] == [0, 1, 2, 3, 4]
    for rep in reports:
        for sid in rep.trained:
            assert rep.version - min_version[sid] <= 1, (rep.step, sid)
    assert len(trained) == len(set(trained)) == 20
    assert not stale_ids & set(trained)
    dropped = {sid for rep in reports for sid in rep.dropped_stale}
    assert dropped <= stale_ids and len(dropped) >= 2
    assert stats["dropped_stale"] == len(dropped) and stats["trained"] == 20
    assert stats["reasons"] == {"stale": len(dropped)}


# -- (b) crash and resume ----------------------------------------------------------------------------

LIFE_ONE = """
import json, sys
import anyio
from actors.learner import LearnerActor
from actors.runtime import Runtime
from engine.config import EngineConfig

cfg = EngineConfig.model_validate_json(sys.argv[1])
out = open(sys.argv[3], "a")

def hook(r):
    out.write(json.dumps({"step": r.step, "trained": r.trained, "filtered": r.filtered,
                          "dropped_stale": r.dropped_stale, "duplicates": r.duplicates}) + "\\n")
    out.flush()

async def main():
    async with Runtime(cfg) as rt:
        await LearnerActor(rt, sys.argv[2], on_step=hook).run()

anyio.run(main)
"""


def crash_layout() -> tuple[list[list[tuple[str, str]]], list[list[tuple[str, str]]]]:
    """Records per partition for two phases as (sample_id, kind); kind is train, filtered or dup.

    Phase one holds 14 trainable samples: exactly 3 steps of 4, with 2 left pending. Duplicates sit in
    the partition of their original, after it. Every partition ends (phase two) with a trainable
    sample, so the last step of the run folds every record in.
    """
    one: list[list[tuple[str, str]]] = [[] for _ in range(PARTITIONS)]
    two: list[list[tuple[str, str]]] = [[] for _ in range(PARTITIONS)]
    for i in range(14):
        one[i % 3].append((f"t{i:02d}", "train"))
    for i in range(3):
        one[i].insert(1, (f"f{i}", "filtered"))
    one[0].append(("t00", "dup"))  # same life, later batch (or same batch)
    one[2].append(("f2", "dup"))
    for sid, p in (("t01", 1), ("t05", 2), ("t12", 0), ("f0", 0)):  # re-emitted after the crash
        two[p].append((sid, "dup"))
    for i in range(3, 6):
        two[i % 3].append((f"f{i}", "filtered"))
    for i in range(14, 28):
        two[i % 3].append((f"t{i:02d}", "train"))
        if i == 15:
            two[0].append(("t15", "dup"))  # re-emitted inside the same batch
    return one, two


async def produce_phase(rt: Runtime, phase: list[list[tuple[str, str]]]) -> None:
    for partition, records in enumerate(phase):
        for sid, kind in records:
            exp = experience(sid, [0] * 4, filtered="zero_variance" if sid.startswith("f") else "")
            await rt.producer.send(rt.names.experience, exp, key=exp.task_id, partition=partition)


async def test_a_crash_after_a_checkpoint_neither_loses_nor_retrains_a_sample(
        kafka_bootstrap, nats_url, unique_name, tmp_path, model_dir):
    cfg = make_cfg(kafka_bootstrap, nats_url, unique_name, tmp_path, max_staleness=1000, publish_every=1,
                   checkpoint_every=2)
    one, two = crash_layout()
    records = [r for phase in (one, two) for part in phase for r in part]
    trainable = {sid for sid, kind in records if kind == "train"}
    filtered = {sid for sid, kind in records if kind == "filtered"}
    n_dups = sum(kind == "dup" for _, kind in records)
    life_one_log = tmp_path / "life1.jsonl"

    def life_one_reports() -> list[dict]:
        if not life_one_log.exists():
            return []
        return [json.loads(line) for line in life_one_log.read_text().splitlines() if line.endswith("}")]

    async with Runtime(cfg) as rt:
        await produce_phase(rt, one)
        proc = subprocess.Popen([sys.executable, "-c", LIFE_ONE, cfg.model_dump_json(), model_dir, str(life_one_log)],
                                cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            # step 3 is reported after its follow-ups, so the step-2 checkpoint is on disk by then
            await wait_until(lambda: len(life_one_reports()) >= 3 or proc.poll() is not None, 120, "life one")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        life_one = life_one_reports()
        assert [r["step"] for r in life_one] == [1, 2, 3]
        await produce_phase(rt, two)

        life_two: list[StepReport] = []
        cfg2 = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_steps": 7})})
        rt.cfg = cfg2
        actor = LearnerActor(rt, model_dir, on_step=life_two.append)
        with anyio.fail_after(120):
            await actor.run()  # returns at max_steps
        status = json.loads(await rt.require_control().kv_get(rt.kv_bucket, Names.LEARNER_VERSION_KEY))

    assert actor.resumed_from is not None and actor.resumed_from.name == "step-00000002-v000002"
    assert [r.step for r in life_two] == [3, 4, 5, 6, 7]
    lineage_trained = [s for r in life_one[:2] for s in r["trained"]] + [s for r in life_two for s in r.trained]
    lineage_filtered = [s for r in life_one[:2] for s in r["filtered"]] + [s for r in life_two for s in r.filtered]
    assert len(lineage_trained) == len(set(lineage_trained)), "a sample was trained twice in the lineage"
    assert set(lineage_trained) == trainable
    assert sorted(lineage_filtered) == sorted(filtered)
    # the lost step's samples were read again after the checkpoint's offsets and trained by life two
    assert set(life_one[2]["trained"]) <= {s for r in life_two for s in r.trained}

    ledger = actor.learner.ledger
    assert (ledger.trained, ledger.dropped_stale, ledger.filtered) == (28, 0, 6)
    assert ledger.consumed == len(trainable | filtered) == 34
    assert ledger.duplicates == n_dups
    ends = {(rt.names.experience, p): len(one[p]) + len(two[p]) for p in range(PARTITIONS)}
    assert actor.learner.offsets == ends
    # life one announced v1..v3 but its checkpoint holds v2: the resumed learner moved past v3
    assert status == {"version": 9, "step": 7, "consumed": 34, "trained": 28, "dropped_stale": 0, "filtered": 6,
                      "never_trained": 6}


# -- (c) weights and status --------------------------------------------------------------------------

async def test_weights_are_published_with_matching_digests_and_the_status_key_is_updated(
        kafka_bootstrap, nats_url, unique_name, tmp_path, model_dir):
    cfg = make_cfg(kafka_bootstrap, nats_url, unique_name, tmp_path, max_staleness=4, publish_every=2, max_steps=2)
    seen_versions: list[int] = []
    async with Runtime(cfg) as rt:
        sub = WeightSubscriber(rt.require_control(), rt.names, tmp_path / "fetched", timeout_s=30)

        async def watch() -> None:
            async for manifest in sub.manifests():
                seen_versions.append(manifest.version)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            batch = [experience("f0", [0] * 4, filtered="zero_variance")]
            batch += [experience(f"s{i}", [0] * 4) for i in range(8)]
            for exp in batch:  # one partition: the filtered record is folded into the first step
                await rt.producer.send(rt.names.experience, exp, key=exp.task_id, partition=0)
            actor = LearnerActor(rt, model_dir)
            with anyio.fail_after(120):
                await actor.run()  # returns at max_steps
            await wait_until(lambda: seen_versions[-1:] == [1], 30, "manifest of version 1")
            tg.cancel_scope.cancel()
        manifest = await WeightPublisher(rt.require_control(), rt.names).latest()
        assert manifest is not None
        vdir = await sub.fetch(manifest)
        raw_status = await rt.require_control().kv_get(rt.kv_bucket, Names.LEARNER_VERSION_KEY)

    assert seen_versions == sorted(set(seen_versions)) and seen_versions[-1] == 1
    assert (manifest.version, manifest.step) == (1, 2)
    names = {obj["name"].split("/", 1)[1] for obj in manifest.objects}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    check_hf_dir(vdir)  # what SGLang's /update_weights_from_disk and --model-path load
    for obj in manifest.objects:
        path = vdir / obj["name"].split("/", 1)[1]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == obj["sha256"]
        assert path.stat().st_size == obj["size"]
    fetched = load_file(vdir / "model.safetensors")
    trained = actor.learner.model.state_dict()
    initial = load_file(Path(model_dir) / "model.safetensors")
    assert set(manifest.tensors) == set(fetched)
    assert all(torch.equal(fetched[k], trained[k]) for k in fetched)
    assert any(not torch.equal(fetched[k], initial[k]) for k in fetched)
    assert json.loads(raw_status) == {"version": 1, "step": 2, "consumed": 9, "trained": 8, "dropped_stale": 0,
                                      "filtered": 1, "never_trained": 1}


# -- drain -------------------------------------------------------------------------------------------

async def test_a_drain_checkpoints_only_completed_steps_and_the_next_life_reads_the_rest(
        kafka_bootstrap, nats_url, unique_name, tmp_path, model_dir):
    cfg = make_cfg(kafka_bootstrap, nats_url, unique_name, tmp_path, max_staleness=1000)
    first: list[StepReport] = []
    second: list[StepReport] = []
    async with Runtime(cfg) as rt:
        for i in range(6):  # one step of 4, two left pending
            exp = experience(f"a{i}", [0] * 4)
            await rt.producer.send(rt.names.experience, exp, key=exp.task_id, partition=0)
        actor = LearnerActor(rt, model_dir, on_step=first.append)
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            await wait_until(lambda: len(first) == 1 and actor.statistics()["pending"] == 2, 60, "step 1")
            actor.request_drain()
        assert actor.last_checkpoint is not None and actor.last_checkpoint.name == "step-00000001-v000001"

        for i in range(6, 8):
            exp = experience(f"a{i}", [0] * 4)
            await rt.producer.send(rt.names.experience, exp, key=exp.task_id, partition=0)
        rt.cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_steps": 2})})
        again = LearnerActor(rt, model_dir, on_step=second.append)
        with anyio.fail_after(60):
            await again.run()

    assert first[0].trained == ("a0", "a1", "a2", "a3")
    assert [(r.step, r.trained) for r in second] == [(2, ("a4", "a5", "a6", "a7"))]
    assert again.learner.offsets == {(rt.names.experience, 0): 8}


async def test_the_learner_and_weight_watchers_use_the_configured_buckets(
        kafka_bootstrap, nats_url, unique_name, tmp_path, model_dir):
    """``nats.kv_bucket`` / ``nats.weights_bucket`` reach every writer and reader (the learner once hard-coded
    "control", so the scheduler, watching the configured bucket, never saw a version and admission stalled)."""
    cfg = make_cfg(kafka_bootstrap, nats_url, unique_name, tmp_path, max_staleness=4, publish_every=1, max_steps=1)
    cfg = cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"kv_bucket": "ctl-custom",
                                                                     "weights_bucket": "w-custom"})})
    async with Runtime(cfg) as rt:
        nats = rt.require_control()
        for i in range(4):
            exp = experience(f"s{i}", [0] * 4)
            await rt.producer.send(rt.names.experience, exp, key=exp.task_id, partition=0)
        actor = LearnerActor(rt, model_dir)
        with anyio.fail_after(120):
            await actor.run()  # returns at max_steps
        status = await nats.kv_get(rt.names.bucket("ctl-custom"), Names.LEARNER_VERSION_KEY)
        assert status is not None and json.loads(status)["version"] == 1
        sub = WeightSubscriber(nats, rt.names, tmp_path / "fetched", timeout_s=30)
        async with contextlib.aclosing(sub.manifests()) as manifests:
            with anyio.fail_after(30):
                manifest = await anext(manifests)
        vdir = await sub.fetch(manifest)
        stray_status = await nats.kv_get(rt.names.bucket("control"), Names.LEARNER_VERSION_KEY)
        stray_manifest = await nats.kv_get(rt.names.bucket("control"), Names.WEIGHTS_KEY)

    assert manifest.version == 1
    assert (sub.bucket, sub.kv_bucket) == (rt.names.bucket("w-custom"), rt.names.bucket("ctl-custom"))
    assert (vdir / "model.safetensors").is_file()
    assert stray_status is None and stray_manifest is None

# -- step log and export -----------------------------------------------------------------------------

async def test_the_step_log_has_each_steps_rewards_and_the_final_weights_are_exported(
        kafka_bootstrap, nats_url, unique_name, tmp_path, model_dir):
    export = tmp_path / "export"
    cfg = make_cfg(kafka_bootstrap, nats_url, unique_name, tmp_path, max_staleness=1000, max_steps=2,
                   export_dir=str(export))
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    async with Runtime(cfg) as rt:
        batch = [dataclasses.replace(experience("f0", [0] * 4, filtered="zero_variance"), reward=0.0)]
        batch += [dataclasses.replace(experience(f"s{i}", [0] * 4), reward=r) for i, r in enumerate(rewards)]
        for exp in batch:  # one partition: the filtered record is folded into the first step
            await rt.producer.send(rt.names.experience, exp, key=exp.task_id, partition=0)
        actor = LearnerActor(rt, model_dir)
        with anyio.fail_after(120):
            await actor.run()  # returns at max_steps, then exports

    rows = [json.loads(line) for line in (tmp_path / "ckpt" / unique_name / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["version"], r["trained"]) for r in rows] == [(1, 0, 4), (2, 1, 4)]
    assert rows[0]["reward_trained"] == 0.25 and rows[0]["reward_all"] == 0.2  # 1 of 4 trained; 1 of 5 folded
    assert rows[1]["reward_trained"] == 0.75 and rows[1]["reward_all"] == 0.75
    assert 0 <= rows[0]["t"] <= rows[1]["t"] and rows[0]["wall"] <= rows[1]["wall"]
    assert "loss" in rows[0] and "grad_norm" in rows[1]
    model, _ = load_model_dir(export)
    trained = actor.learner.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert not list(tmp_path.glob(".export.tmp-*"))
