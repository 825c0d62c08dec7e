"""Stream-layer throughput: the adapter vs the raw clients, measured in the same run.

Kafka: N records of 1 KiB and of 256 KiB produced (acks=all, idempotent, lz4) and consumed back,
once through raw kafka-python and once through ``streams.kafka`` (Producer / Consumer, which add the
envelope, the off-loop hand-off, decode and commit bookkeeping). Both paths send the same encoded
records, so the ratio is the cost of the adapter, not of MessagePack.

NATS: objects of 4 MiB and of 64 MiB (16 MiB with --quick) through ``streams.nats`` (put_file /
get_file that stream through files and check the digest) and through raw nats-py (put of bytes / get
without writeinto).

    python -m loadtests.streams [--quick] [--json out.json] [--bootstrap H:P] [--nats URL]

With no --bootstrap / --nats (or ROLLOUT_KAFKA_BOOTSTRAP / ROLLOUT_NATS_URL) it starts a private
broker and nats-server on free ports and stops them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import numpy as np
from kafka import KafkaConsumer, KafkaProducer


from engine.config import KafkaConfig, NatsConfig  # noqa: E402
from engine.schemas import TokenChunk  # noqa: E402
from streams.codec import encode  # noqa: E402
from streams.kafka import Consumer, Producer, ensure_topics  # noqa: E402
from streams.nats import Nats  # noqa: E402


def _records(n: int, size: int) -> list[TokenChunk]:
    per = max(1, size // 8)  # int32 token + float32 logprob per token
    ids = np.arange(per, dtype=np.int32)
    lps = np.zeros(per, dtype=np.float32)
    return [TokenChunk(sample_id=f"s{i}", task_id=f"t{i % 64}", seq=i, token_ids=ids, logprobs=lps,
                       weight_version=0) for i in range(n)]


def raw_produce(bootstrap: str, topic: str, msgs: list[TokenChunk]) -> float:
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, compression_type="lz4",
                      linger_ms=5, batch_size=256 * 1024, max_request_size=9 * 1024 * 1024)
    t0 = time.perf_counter()
    for m in msgs:
        value, mid = encode(m, producer="raw")
        p.send(topic, value=value, key=m.sample_id.encode(), headers=[("message_id", mid.encode())])
    p.flush()
    dt = time.perf_counter() - t0
    p.close()
    return dt


async def adapter_produce(cfg: KafkaConfig, topic: str, msgs: list[TokenChunk]) -> float:
    async with Producer(cfg, producer_id="bench") as p:
        t0 = time.perf_counter()
        for m in msgs:
            await p.wait_room()
            p.send_nowait(topic, m, key=m.sample_id)
        await p.flush()
        return time.perf_counter() - t0


def raw_consume(bootstrap: str, topic: str, n: int) -> float:
    from streams.codec import decode

    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"raw-{uuid.uuid4().hex[:6]}",
                      auto_offset_reset="earliest", enable_auto_commit=False, max_poll_records=500,
                      fetch_max_bytes=52428800, max_partition_fetch_bytes=9 * 1024 * 1024)
    got = 0
    t0 = time.perf_counter()
    while got < n:
        for recs in c.poll(timeout_ms=500).values():
            for r in recs:
                decode(r.value)
                got += 1
        c.commit()
    dt = time.perf_counter() - t0
    c.close()
    return dt


async def adapter_consume(cfg: KafkaConfig, topic: str, n: int) -> float:
    async with Consumer(cfg, topics=[topic], group=f"ad-{uuid.uuid4().hex[:6]}") as c:
        got = 0
        t0 = time.perf_counter()
        while got < n:
            for r in await c.getmany(timeout_s=0.5):
                r.ack()
                got += 1
            await c.commit()
        return time.perf_counter() - t0


async def bench_kafka(bootstrap: str, n: int, size: int, label: str, rows: list, out: dict) -> None:
    cfg = KafkaConfig(bootstrap=bootstrap)
    run = uuid.uuid4().hex[:6]
    raw_topic, ad_topic = f"bench.{run}.raw.{label}", f"bench.{run}.ad.{label}"
    await ensure_topics(cfg, {raw_topic: 3, ad_topic: 3})
    msgs = _records(n, size)
    mb = sum(len(encode(m, producer="x")[0]) for m in msgs[:10]) / 10 * n / 1e6
    # Alternate order so neither path always runs on a warm broker.
    t_ad = await adapter_produce(cfg, ad_topic, msgs)
    t_raw = await anyio.to_thread.run_sync(raw_produce, bootstrap, raw_topic, msgs)
    c_raw = await anyio.to_thread.run_sync(raw_consume, bootstrap, raw_topic, n)
    c_ad = await adapter_consume(cfg, ad_topic, n)
    for what, t_r, t_a in (("produce", t_raw, t_ad), ("consume", c_raw, c_ad)):
        rows.append((f"kafka {what} {label}", n / t_r, n / t_a, mb / t_r, mb / t_a, t_r / t_a))
        out[f"raw_{what}_rps_{label}"] = round(n / t_r, 1)
        out[f"adapter_{what}_rps_{label}"] = round(n / t_a, 1)
    # Headline: the whole round trip (produce + consume) through each path.
    out[f"adapter_vs_raw_{label}"] = round((t_raw + c_raw) / (t_ad + c_ad), 3)


async def bench_objstore(nats_url: str, size_mb: int, rows: list, out: dict, suffix: str = "") -> None:
    cfg = NatsConfig(url=nats_url, timeout_s=120)
    bucket = f"bench-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "blob"
        data = os.urandom(size_mb << 20)
        src.write_bytes(data)
        async with Nats(cfg) as n:
            store = await n.object_store(bucket)
            t0 = time.perf_counter()
            await store.put("raw", data)
            put_raw = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = await store.get("raw")
            get_raw = time.perf_counter() - t0
            assert res.data is not None and len(res.data) == len(data)
            del res
            t0 = time.perf_counter()
            info = await n.put_file(bucket, "adapter", src)
            put_ad = time.perf_counter() - t0
            t0 = time.perf_counter()
            await n.get_file(bucket, "adapter", Path(tmp) / "copy", sha256=info["sha256"])
            get_ad = time.perf_counter() - t0
    rows.append((f"objstore put {size_mb} MiB", size_mb / put_raw, size_mb / put_ad, size_mb / put_raw,
                 size_mb / put_ad, put_raw / put_ad))
    rows.append((f"objstore get {size_mb} MiB", size_mb / get_raw, size_mb / get_ad, size_mb / get_raw,
                 size_mb / get_ad, get_raw / get_ad))
    out[f"objstore_put_mbps{suffix}"] = round(size_mb * 1.048576 / put_ad, 1)
    out[f"objstore_get_mbps{suffix}"] = round(size_mb * 1.048576 / get_ad, 1)
    out[f"objstore_put_vs_raw{suffix}"] = round(put_raw / put_ad, 3)
    out[f"objstore_get_vs_raw{suffix}"] = round(get_raw / get_ad, 3)


@contextlib.contextmanager
def _infra(bootstrap: str | None, nats_url: str | None):
    if bootstrap and nats_url:
        yield bootstrap, nats_url
        return
    from loadtests._infra import private_stack  # started on free ports, stopped by pid

    with private_stack() as (b, n):
        yield bootstrap or b, nats_url or n


async def main_async(args: argparse.Namespace) -> dict:
    rows: list = []
    out: dict = {}
    n1k = 5000 if args.quick else 50000
    n256 = 100 if args.quick else 600
    with _infra(args.bootstrap, args.nats) as (bootstrap, nats_url):
        await bench_kafka(bootstrap, n1k, 1024, "1k", rows, out)
        await bench_kafka(bootstrap, n256, 256 * 1024, "256k", rows, out)
        await bench_objstore(nats_url, 4, rows, out, suffix="_4mib")  # a small model's weights
        await bench_objstore(nats_url, 16 if args.quick else 64, rows, out)
    print(f"{'path':<26}{'raw rec/s':>12}{'adapter rec/s':>15}{'raw MB/s':>10}{'adapter MB/s':>14}{'ratio':>8}")
    for name, rr, ar, rm, am, ratio in rows:
        print(f"{name:<26}{rr:>12.0f}{ar:>15.0f}{rm:>10.1f}{am:>14.1f}{ratio:>8.2f}")
    print("\nheadline:", {k: out[k] for k in ("adapter_vs_raw_1k", "adapter_vs_raw_256k", "objstore_put_mbps",
                                            "objstore_get_mbps")})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run under a minute")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    p.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"))
    p.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL"))
    args = p.parse_args()
    out = anyio.run(main_async, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
