"""The stream layer against the real Kafka broker and nats-server."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest

from engine.actor import Actor, RestartPolicy, Supervisor
from engine.config import KafkaConfig, NatsConfig
from engine.schemas import DeadLetter, Task, TokenChunk
from streams.codec import decode, encode
from streams.kafka import Consumer, Producer, ensure_topics
from streams.nats import Nats, NatsError

pytestmark = pytest.mark.anyio

HELPER = Path(__file__).parent / "helpers" / "stream_consumer.py"


def _task(i: int) -> Task:
    return Task(task_id=f"task-{i}", domain="arith", prompt=f"{i}+{i}=", spec={"answer": str(2 * i)})


def _ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]


def _ready(path: Path) -> bool:
    return path.exists() and path.read_text().startswith("#ready")


def _owned(path: Path) -> list[tuple[int, int]]:
    """The member's ``#owned P MS`` lines: partition P, processed while owned since MS."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(ln.split()[1]), int(ln.split()[2])) for ln in lines if ln.startswith("#owned")]


def _revoked(path: Path) -> list[tuple[int, int]]:
    """The member's ``#revoked P MS`` lines: partition P taken from it at MS."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(ln.split()[1]), int(ln.split()[2])) for ln in lines if ln.startswith("#revoked")]


def _assigned(path: Path) -> int:
    """The member's current partition count, from its last ``#assigned N`` line."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("#assigned")] if path.exists() else []
    return int(lines[-1].split()[1]) if lines else 0


async def _wait_for(cond, timeout_s: float, what: str, interval: float = 0.05) -> None:
    with anyio.move_on_after(timeout_s):
        while not cond():
            await anyio.sleep(interval)
        return
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def test_group_of_three_with_a_sigkill_loses_nothing(kafka_bootstrap, unique_name, tmp_path):
    cfg = KafkaConfig(bootstrap=kafka_bootstrap)
    topic, group = f"{unique_name}.tasks", f"{unique_name}.g"
    await ensure_topics(cfg, {topic: 6})
    outs = [tmp_path / f"c{i}.txt" for i in range(3)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = [subprocess.Popen([sys.executable, str(HELPER), "--bootstrap", kafka_bootstrap, "--topic", topic,
                               "--group", group, "--out", str(o)], env=env) for o in outs]
    try:
        await _wait_for(lambda: all(_ready(o) for o in outs), 60, "consumers ready")
        # every member holds partitions before the first record: the kill then hits a real owner
        await _wait_for(lambda: sum(map(_assigned, outs)) == 6, 180, "the group to own the 6 partitions")
        sent: list[str] = []

        def seen() -> set[str]:
            return set().union(*(_ids(o) for o in outs))

        victim: int | None = None
        async with Producer(cfg, producer_id="test") as producer:
            for i in range(10_000):
                await producer.wait_room()
                _, mid = producer.send_nowait(topic, _task(i), key=f"task-{i}")
                sent.append(mid)
                if i % 500 == 499:
                    # pace production to consumption, and kill one member once it has done part of its share
                    await producer.flush()
                    await _wait_for(lambda: len(seen()) >= len(sent) - 1000, 120, "consumers keeping up")
                    if victim is None:  # kill the first member that has done part of its share
                        victim = next((k for k in range(3) if len(_ids(outs[k])) >= 200), None)
                        if victim is not None:
                            killed_ms = time.time_ns() // 1_000_000
                            procs[victim].send_signal(signal.SIGKILL)
                            procs[victim].wait(10)
            await producer.flush()
        assert victim is not None and procs[victim].returncode == -signal.SIGKILL

        await _wait_for(lambda: len(seen()) >= len(sent), 120, "all records consumed", interval=0.2)
        assert seen() == set(sent)  # nothing lost, nothing invented
        total = sum(len(_ids(o)) for o in outs)
        assert total >= len(sent)  # duplicates (from the victim's uncommitted batch) are allowed
        assert any(len(_ids(outs[k])) > 0 for k in range(3) if k != victim)  # survivors took over
        # a partition the victim worked on: a survivor that owns it after the victim says it owns it since the
        # victim lost it (at a revocation the victim wrote, else at the kill), never earlier: what an inference
        # actor taking over needs, to know a record may have been worked on by the dead member. (The victim can
        # have lost partitions to a rebalance before the kill: cooperative assignment moves them as members join.)
        victim_since: dict[int, int] = {}
        for p, ms in _owned(outs[victim]):
            victim_since[p] = max(ms, victim_since.get(p, ms))
        lost_at = {p: min([ms for q, ms in _revoked(outs[victim]) if q == p and ms >= since] + [killed_ms])
                   for p, since in victim_since.items()}
        moved = [(p, ms, lost_at[p]) for k in range(3) if k != victim for p, ms in _owned(outs[k])
                 if p in victim_since and ms > victim_since[p]]
        assert moved and all(ms >= lost for _, ms, lost in moved), (moved, killed_ms)
        assert any(lost == killed_ms for _, _, lost in moved)  # the kill itself handed partitions over
        # a survivor's ownership time of a partition changes only when the group really took the partition from
        # it in between (the assignor is sticky; under load a member can be evicted and rejoin, or be given a
        # partition the victim held but had not read from yet): never a bump without a revocation
        for k in range(3):
            if k == victim:
                continue
            taken = _revoked(outs[k])
            times: dict[int, set[int]] = {}
            for p, ms in _owned(outs[k]):
                times.setdefault(p, set()).add(ms)
            for p, owned in times.items():
                ordered = sorted(owned)
                for since, later in zip(ordered, ordered[1:]):
                    assert any(q == p and since <= ms <= later for q, ms in taken), (k, p, since, later, taken)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for k, p in enumerate(procs) if k != victim)


async def test_poison_records_go_to_the_dead_letter_topic_and_the_consumer_goes_on(kafka_bootstrap, unique_name):
    # The consumer accepts records up to 64 KiB; the producer may send larger ones.
    consumer_cfg = KafkaConfig(bootstrap=kafka_bootstrap, max_record_bytes=64 * 1024)
    producer_cfg = KafkaConfig(bootstrap=kafka_bootstrap)
    topic, dlq = f"{unique_name}.tasks", f"{unique_name}.dlq"
    await ensure_topics(producer_cfg, {topic: 2, dlq: 1})
    good_env = msgpack.unpackb(encode(_task(0), producer="t")[0], raw=False)
    wrong_version = msgpack.packb({**good_env, "version": 99}, use_bin_type=True)
    bad_utf8 = encode(_task(1), producer="t")[0].replace(b"1+1=", b"\xff\xfe+=")
    oversized = encode(Task(task_id="big", domain="arith", prompt="x" * 100_000, spec={}), producer="t")[0]
    poison = {b"random": os.urandom(300), b"version": wrong_version, b"badtext": bad_utf8, b"big": oversized,
              b"chunk-on-tasks": encode(TokenChunk(sample_id="s", task_id="t", seq=0,
                                                   token_ids=np.zeros(1, np.int32),
                                                   logprobs=np.zeros(1, np.float32),
                                                   weight_version=0), producer="t")[0]}
    good_ids = []
    async with Producer(producer_cfg, producer_id="test") as producer:
        for i in range(50):
            _, mid = producer.send_nowait(topic, _task(i), key=f"task-{i}")
            good_ids.append(mid)
            if i % 10 == 5:
                for k, v in poison.items():
                    producer.send_raw_nowait(topic, v, key=k + str(i).encode())
        await producer.flush()
        async with Consumer(consumer_cfg, topics=[topic], group=f"{unique_name}.g", expect=("task",),
                            dead_letters=producer, dlq_topic=dlq) as consumer:
            got = []
            with anyio.fail_after(60):
                while len(got) < len(good_ids):
                    for r in await consumer.getmany(timeout_s=0.5):
                        got.append(r.message_id)
                        r.ack()
            await consumer.commit()
            assert sorted(got) == sorted(good_ids)
            assert consumer.dead_lettered == 5 * len(poison)
            lag = await consumer.lag()
            assert sum(lag.values()) == 0  # poison offsets were committed too
    letters = []
    async with Consumer(producer_cfg, topics=[dlq], group=f"{unique_name}.dlqreader", expect=("dead_letter",)) as reader:
        with anyio.fail_after(60):
            while len(letters) < 5 * len(poison):
                letters += [r for r in await reader.getmany(timeout_s=0.5)]
    reasons: dict[str, str] = {}
    for r in letters:
        letter = r.message
        assert isinstance(letter, DeadLetter)
        assert letter.topic == topic and letter.offset >= 0 and letter.error
        reasons[r.key.rstrip("0123456789")] = letter.reason
    assert reasons == {"random": "undecodable", "version": "unsupported_version", "badtext": "undecodable",
                       "big": "oversized", "chunk-on-tasks": "unknown_schema"}


async def test_nats_object_store_round_trip_of_200_mb(nats_url, unique_name, tmp_path):
    src = tmp_path / "blob.bin"
    digest = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(200):
            chunk = os.urandom(1 << 20)
            digest.update(chunk)
            f.write(chunk)
    async with Nats(NatsConfig(url=nats_url, timeout_s=60)) as n:
        bucket = unique_name.replace(".", "-")
        info = await n.put_file(bucket, "blob", src)
        assert info["size"] == 200 << 20 and info["sha256"] == digest.hexdigest()
        dst = tmp_path / "copy.bin"
        size = await n.get_file(bucket, "blob", dst, sha256=info["sha256"])
        assert size == 200 << 20
        with open(dst, "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == digest.hexdigest()
        # a wrong digest is refused and leaves no file behind
        with pytest.raises(Exception, match="does not match"):
            await n.get_file(bucket, "blob", tmp_path / "bad.bin", sha256="0" * 64)
        assert not (tmp_path / "bad.bin").exists()


async def test_an_object_read_cut_short_leaves_no_subscription_behind(nats_url, unique_name, tmp_path):
    """A weight fetch that fails or is cancelled half-way ends its chunk subscription.

    (nats-py's ``ObjectStore.get`` unsubscribes only after the last chunk: a cancelled fetch left the
    rest of the object buffered in the process and held ``drain`` up at close.)
    """
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(4 << 20))  # 32 chunks of 128 KiB
    async with Nats(NatsConfig(url=nats_url, timeout_s=30)) as n:
        bucket = unique_name.replace(".", "-")
        await n.put_file(bucket, "blob", src)
        store = await n.object_store(bucket)
        assert n.nc is not None
        baseline = set(n.nc._subs)

        written: list[int] = []

        def failing_write(data: bytes) -> None:
            written.append(len(data))
            raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            await n._read_object(store, bucket, "blob", failing_write)
        assert written == [128 << 10]
        assert set(n.nc._subs) == baseline

        with anyio.CancelScope() as scope:
            def cancel_after_the_first_chunk(data: bytes) -> None:
                written.append(len(data))
                anyio.from_thread.run_sync(scope.cancel)

            await n._read_object(store, bucket, "blob", cancel_after_the_first_chunk)
        assert scope.cancelled_caught and len(written) == 2
        assert set(n.nc._subs) == baseline

        # the same object still reads back whole, and that read leaves nothing behind either
        dst = tmp_path / "copy.bin"
        assert await n.get_file(bucket, "blob", dst, sha256=hashlib.sha256(src.read_bytes()).hexdigest()) == 4 << 20
        assert dst.read_bytes() == src.read_bytes()
        assert set(n.nc._subs) == baseline


async def test_object_writes_interoperate_with_nats_py_and_a_failed_write_leaves_no_chunks(
        nats_url, unique_name, tmp_path):
    """``put_file`` pipelines its chunks but writes nats-py's layout; a write cut short purges its chunks."""
    first, second = os.urandom((3 << 20) + 12345), os.urandom(1 << 20)
    src = tmp_path / "w.bin"
    src.write_bytes(first)
    async with Nats(NatsConfig(url=nats_url, timeout_s=30)) as n:
        bucket = unique_name.replace(".", "-")
        info = await n.put_file(bucket, "w", src)
        assert info == {"name": "w", "size": len(first), "sha256": hashlib.sha256(first).hexdigest()}
        store = await n.object_store(bucket)
        assert (await store.get("w")).data == first  # nats-py reads what we wrote, digest checked
        assert n.js is not None
        stream = f"OBJ_{bucket}"
        chunks_of_first = (await n.js.stream_info(stream)).state.messages

        # a new version replaces the old one and purges its chunks
        src.write_bytes(second)
        await n.put_file(bucket, "w", src)
        assert (await store.get("w")).data == second
        settled = (await n.js.stream_info(stream)).state.messages
        assert settled == 8 + 1 < chunks_of_first  # 8 chunks of 128 KiB and the metadata message

        # what nats-py writes, we read
        await store.put("theirs", first)
        assert await n.get_file(bucket, "theirs", tmp_path / "theirs.bin",
                                sha256=hashlib.sha256(first).hexdigest()) == len(first)
        assert (tmp_path / "theirs.bin").read_bytes() == first
        settled = (await n.js.stream_info(stream)).state.messages

        # a write whose source fails half-way, and one cancelled half-way, leave no chunks behind
        reads: list[int] = []

        def failing_read(size: int) -> bytes:
            reads.append(size)
            if len(reads) > 3:
                raise OSError("read error")
            return os.urandom(size)

        with pytest.raises(OSError, match="read error"):
            await n._write_object(store, bucket, "broken", failing_read)
        reads.clear()
        with anyio.CancelScope() as scope:
            def cancelling_read(size: int) -> bytes:
                reads.append(size)
                if len(reads) == 3:
                    anyio.from_thread.run_sync(scope.cancel)
                return os.urandom(size)

            await n._write_object(store, bucket, "cancelled", cancelling_read)
        assert scope.cancelled_caught
        assert (await n.js.stream_info(stream)).state.messages == settled
        with pytest.raises(NatsError, match="not found"):
            await n.get_file(bucket, "broken", tmp_path / "broken.bin")
        assert not (tmp_path / "broken.bin").exists() and not (tmp_path / "broken.bin.part").exists()


async def test_nats_kv_put_get_watch(nats_url, unique_name):
    async with Nats(NatsConfig(url=nats_url)) as n:
        bucket = unique_name.replace(".", "-")
        assert await n.kv_get(bucket, "k") is None
        await n.kv_put(bucket, "k", b"v1")
        seen = []
        async with anyio.create_task_group() as tg:
            async def watch():
                async for value in n.kv_watch(bucket, "k"):
                    seen.append(value)
                    if value == b"v3":
                        tg.cancel_scope.cancel()
            tg.start_soon(watch)
            await _wait_for(lambda: seen == [b"v1"], 10, "initial value")
            await n.kv_put(bucket, "k", b"v2")
            await n.kv_put(bucket, "k", b"v3")
        assert seen == [b"v1", b"v2", b"v3"]
        assert await n.kv_get(bucket, "k") == b"v3"


class _CrashOnce(Actor):
    """Consumes a topic; crashes (once, before acking) on the record marked 'crash'."""

    role = "crash-once"

    def __init__(self, cfg: KafkaConfig, topic: str, group: str, processed: list[str], state: dict) -> None:
        super().__init__()
        self.cfg, self.topic, self.group, self.processed, self.state = cfg, topic, group, processed, state
        self.consumer: Consumer | None = None

    async def setup(self):
        self.consumer = await Consumer(self.cfg, topics=[self.topic], group=self.group).start()

    async def serve(self):
        assert self.consumer is not None
        while not self.draining:
            for r in await self.consumer.getmany(timeout_s=0.2):
                if r.message.task_id == "task-25" and not self.state.get("crashed"):
                    self.state["crashed"] = True
                    raise RuntimeError("simulated crash in the middle of a batch")
                self.processed.append(r.message_id)
                r.ack()
            await self.consumer.commit()

    async def teardown(self):
        if self.consumer is not None:
            await self.consumer.close()


async def test_supervisor_restarts_a_crashing_actor_and_no_record_is_lost(kafka_bootstrap, unique_name):
    cfg = KafkaConfig(bootstrap=kafka_bootstrap)
    topic = f"{unique_name}.tasks"
    await ensure_topics(cfg, {topic: 1})
    async with Producer(cfg, producer_id="test") as producer:
        ids = [producer.send_nowait(topic, _task(i), key="k")[1] for i in range(50)]
        await producer.flush()
    processed: list[str] = []
    state: dict = {}
    sup = Supervisor(RestartPolicy(max_restarts=3, backoff_initial_s=0.01), drain_timeout_s=20)
    sup.add("crash-once", lambda: _CrashOnce(cfg, topic, f"{unique_name}.g", processed, state))
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await _wait_for(lambda: set(processed) >= set(ids), 60, "all processed")
        sup.drain()
    assert state["crashed"] and sup.restarts("crash-once") == 1
    assert set(processed) == set(ids)


def test_decode_of_a_record_read_back_from_the_broker_matches(kafka_bootstrap, unique_name):
    """Any Kafka client can produce a task from the documented schema (here: raw kafka-python + msgpack)."""
    from kafka import KafkaConsumer, KafkaProducer

    cfg = KafkaConfig(bootstrap=kafka_bootstrap)
    topic = f"{unique_name}.tasks"
    anyio.run(ensure_topics, cfg, {topic: 1})
    value = msgpack.packb({"schema": "task", "version": 1, "id": "ext-1", "created_at": time.time(),
                           "producer": "other-tool",
                           "body": {"task_id": "t-ext", "domain": "arith", "prompt": "2+2=",
                                    "spec": {"answer": "4"}, "group_size": 2}}, use_bin_type=True)
    p = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    p.send(topic, value=value, key=b"t-ext").get(30)
    p.close()
    c = KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=10000, group_id=f"{unique_name}.raw")
    rec = next(iter(c))
    c.close()
    env = decode(rec.value)
    assert env.id == "ext-1" and env.message.task_id == "t-ext" and env.message.group_size == 2
