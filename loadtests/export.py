"""Export throughput: ``rollout export`` (actors.export) rows/s against raw kafka-python reading the same topic.

One private broker; N experience records (20000; 3000 with --quick) produced once, then read in the same
run by (a) ``export_jsonl`` (decode, filter, JSON rows, fsync, position file) and (b) a raw
``kafka.KafkaConsumer`` that only counts records. ``export_vs_raw`` is export rows/s over raw rows/s.
The export's end-of-log wait (``idle_s``) is subtracted from its time, since it is not reading work.

    python -m loadtests.export [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

from actors.export import ExportFilter, export_jsonl
from engine.config import KafkaConfig
from engine.schemas import Experience
from loadtests import _infra
from streams.kafka import Producer, ensure_topics

TOPIC = "loadtest.rollout.experience"
IDLE_S = 1.0


def _exp(i: int) -> Experience:
    n = 64
    return Experience(sample_id=f"s{i}", task_id=f"t{i // 4}", domain="math", prompt_ids=np.arange(32, dtype=np.int32),
                      response_ids=np.arange(n, dtype=np.int32), logprobs=np.full(n, -1.0, dtype=np.float32),
                      loss_mask=np.ones(n, dtype=np.uint8), weight_versions=np.zeros(n, dtype=np.int32),
                      reward=float(i % 2), advantage=0.0, group_size=4)


async def _produce(cfg: KafkaConfig, n: int) -> None:
    await ensure_topics(cfg, {TOPIC: 1})
    async with Producer(cfg, producer_id="loadtest-export") as producer:
        for i in range(n):
            await producer.wait_room()
            producer.send_nowait(TOPIC, _exp(i), key=f"t{i // 4}")
        await producer.flush()


def _raw(bootstrap: str, n: int) -> float:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    consumer.assign([TopicPartition(TOPIC, 0)])
    t0 = time.perf_counter()
    seen = 0
    while seen < n:
        seen += sum(len(v) for v in consumer.poll(timeout_ms=500).values())
    elapsed = time.perf_counter() - t0
    consumer.close()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3000 records instead of 20000")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    args = p.parse_args()
    n = 3000 if args.quick else 20000
    with _infra.private_stack() as (bootstrap, _nats), tempfile.TemporaryDirectory() as tmp:
        cfg = KafkaConfig(bootstrap=bootstrap, default_partitions=1)
        anyio.run(_produce, cfg, n)
        raw_s = _raw(bootstrap, n)
        out = Path(tmp) / "traj.jsonl"
        t0 = time.perf_counter()
        read, written = anyio.run(lambda: export_jsonl(cfg, TOPIC, out, ExportFilter(), idle_s=IDLE_S))
        export_s = time.perf_counter() - t0 - IDLE_S
    assert read == written == n, (read, written, n)
    figures = {"records": n, "raw_rows_per_s": round(n / raw_s, 1), "export_rows_per_s": round(n / export_s, 1),
               "export_vs_raw": round(raw_s / export_s, 3), "simulated": False}
    print(f"{'path':<28}{'rows/s':>12}")
    print(f"{'raw kafka-python (count)':<28}{figures['raw_rows_per_s']:>12}")
    print(f"{'rollout export (JSONL)':<28}{figures['export_rows_per_s']:>12}")
    print(f"export_vs_raw = {figures['export_vs_raw']} ({n} records; synthetic 96-token experience rows)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
