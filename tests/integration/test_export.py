"""`rollout export` against the real broker: filtered rows, resumption from the position file, datasets load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actors.export import ExportError, ExportFilter, export_jsonl, export_parquet, position_path
from engine.config import KafkaConfig
from engine.schemas import Experience
from streams.kafka import Producer, ensure_topics

pytestmark = pytest.mark.anyio


def _exp(sid: str, domain: str, reward: float, version: int) -> Experience:
    return Experience(sample_id=sid, task_id=f"task-{sid}", domain=domain, prompt_ids=np.arange(3, dtype=np.int32),
                      response_ids=np.arange(2, dtype=np.int32), logprobs=np.full(2, -1.5, dtype=np.float32),
                      loss_mask=np.ones(2, dtype=np.uint8), weight_versions=np.full(2, version, dtype=np.int32),
                      reward=reward, advantage=0.5, group_size=2, facts={"answer": "5"})


async def test_export_filters_resumes_and_loads_with_datasets(
        kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1)
    topic = f"{unique_name}.rollout.experience"
    await ensure_topics(cfg, {topic: 2})
    out = tmp_path / "traj.jsonl"
    flt = ExportFilter(domains=frozenset({"math"}), min_reward=0.5)
    async with Producer(cfg, producer_id="export-test") as producer:
        for exp in (_exp("a", "math", 1.0, 0), _exp("b", "math", 0.0, 0), _exp("c", "arith", 1.0, 1)):
            await producer.send(topic, exp, key=exp.task_id)
        assert await export_jsonl(cfg, topic, out, flt, idle_s=2.0) == (3, 1)
        assert await export_jsonl(cfg, topic, out, flt, idle_s=1.0) == (0, 0)  # resumed at the end: nothing again
        await producer.send(topic, _exp("d", "math", 0.75, 2), key="task-d")
        assert await export_jsonl(cfg, topic, out, flt, idle_s=2.0) == (1, 1)
    assert sum(json.loads(position_path(out).read_text()).values()) == 4

    import datasets

    ds = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert ds["sample_id"] == ["a", "d"] and ds["weight_versions"] == [[0, 0], [2, 2]]
    assert ds["logprobs"][0] == [-1.5, -1.5] and json.loads(ds["facts"][0]) == {"answer": "5"}

    parquet = tmp_path / "traj-parquet"
    assert await export_parquet(cfg, topic, parquet, flt, idle_s=2.0) == (4, 2)
    assert await export_parquet(cfg, topic, parquet, flt, idle_s=1.0) == (0, 0)
    pq = datasets.load_dataset("parquet", data_files=str(parquet / "*.parquet"), split="train",
                               cache_dir=str(tmp_path / "hf2"))
    assert sorted(pq["sample_id"]) == ["a", "d"]

    with pytest.raises(ExportError, match="cannot open for writing"):
        await export_jsonl(cfg, topic, tmp_path / "missing-dir" / "x.jsonl", flt, idle_s=0.5)


async def test_export_cli_writes_rows_and_fails_clearly_on_a_bad_path(
        kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    cfg = KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1)
    topic = f"{unique_name}.rollout.experience"
    await ensure_topics(cfg, {topic: 1})
    async with Producer(cfg, producer_id="export-cli-test") as producer:
        for exp in (_exp("a", "math", 1.0, 0), _exp("b", "math", 0.0, 0)):
            await producer.send(topic, exp, key=exp.task_id)
    config = tmp_path / "c.toml"
    config.write_text(f'namespace = "{unique_name}"\n[kafka]\nbootstrap = "{kafka_bootstrap}"\n')
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))

    def export(out: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ops.cli", "export", "--config", str(config), "--out", str(out),
                               "--min-reward", "0.5", "--idle-s", "2"], capture_output=True, text=True, env=env,
                              timeout=120)

    ok = export(tmp_path / "t.jsonl")
    assert ok.returncode == 0, ok.stderr
    assert f"1 rows written (2 records read from {topic})" in ok.stdout
    assert [json.loads(line)["sample_id"] for line in (tmp_path / "t.jsonl").read_text().splitlines()] == ["a"]
    bad = export(tmp_path / "no-dir" / "t.jsonl")
    assert bad.returncode == 1 and "rollout export:" in bad.stderr and "cannot open for writing" in bad.stderr
    assert "Traceback" not in bad.stderr
