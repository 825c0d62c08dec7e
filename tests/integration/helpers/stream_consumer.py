"""A consumer-group member run as its own process by the stream integration tests.

Writes ``#ready`` once started, ``#assigned N`` whenever its partition count changes, ``#owned P MS``
the first time it processes a record of partition P it owns since MS (``Record.owned_since_ms``) and
``#revoked P MS`` when the group takes partition P from it at MS (revoked or lost, written and flushed by
the consumer's rebalance callback before the partition is given up: under load a member can be evicted and
get its own partitions back); appends the message id of every record it processes to OUT (one per line,
flushed) *before* acknowledging it, commits after each batch, and exits 0 on SIGTERM after a clean close.
A SIGKILL therefore leaves processed-but-uncommitted records, which the group must re-deliver elsewhere.
"""

import argparse
import os
import signal
import threading
import time

import anyio

from engine.config import KafkaConfig
from streams.kafka import Consumer


async def main(args: argparse.Namespace) -> None:
    cfg = KafkaConfig(bootstrap=args.bootstrap)
    stop = anyio.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # the file outlives the consumer: closing the consumer revokes its partitions, which writes lines
    with open(args.out, "a", buffering=1) as out:
        async with Consumer(cfg, topics=[args.topic], group=args.group, max_poll_records=200) as consumer:
            out.write(f"#ready {os.getpid()}\n")
            # The rebalance callback runs in kafka-python's thread: it writes its line itself, before the
            # consumer gives the partitions up, so a SIGKILL after a revocation never hides it.
            lock = threading.Lock()
            on_revoked = consumer._on_revoked

            def revoked(tps, *, commit=True):
                now_ms = time.time_ns() // 1_000_000
                with lock:
                    out.writelines(f"#revoked {tp.partition} {now_ms}\n" for tp in tps)
                    out.flush()
                    os.fsync(out.fileno())
                on_revoked(tps, commit=commit)

            consumer._on_revoked = revoked
            assigned: set = set()
            owned: set = set()
            while not stop.is_set():
                records = await consumer.getmany(timeout_s=0.2)
                with lock:
                    if consumer.assigned != assigned:
                        assigned = set(consumer.assigned)
                        out.write(f"#assigned {len(assigned)}\n")
                    for r in records:
                        if (r.partition, r.owned_since_ms) not in owned:
                            owned.add((r.partition, r.owned_since_ms))
                            out.write(f"#owned {r.partition} {r.owned_since_ms}\n")
                        out.write(r.message_id + "\n")
                        r.ack()
                    if records:
                        out.flush()
                        os.fsync(out.fileno())
                if records:
                    await consumer.commit()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--out", required=True)
    anyio.run(main, p.parse_args())
