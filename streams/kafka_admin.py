"""Topic administration: create the deployment's topics (and grow their partitions), wait until usable."""

from __future__ import annotations

import time

import anyio
from kafka import KafkaAdminClient
from kafka.admin import NewPartitions, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from engine.config import KafkaConfig, check_files
from streams.kafka_client import StreamError, _connect_error, _construct, client_security


def _ensure_topics_sync(cfg: KafkaConfig, topics: dict[str, int]) -> None:
    admin = _construct(KafkaAdminClient, bootstrap_servers=cfg.bootstrap, client_id="rollout-admin",
                       request_timeout_ms=30000, **client_security(cfg))
    try:
        existing = set(admin.list_topics())
        new = [NewTopic(name=t, num_partitions=n, replication_factor=cfg.replication_factor)
               for t, n in topics.items() if t not in existing]
        if new:
            try:
                admin.create_topics(new, timeout_ms=30000)
            except TopicAlreadyExistsError:
                pass  # created concurrently by another process: fine
        # Grow (never shrink) partition counts of existing topics to the configured number.
        grow = {}
        if existing & topics.keys():
            for desc in admin.describe_topics([t for t in topics if t in existing]):
                have = len(desc["partitions"])
                want = topics[desc["name"]]
                if want > have:
                    grow[desc["name"]] = NewPartitions(total_count=want)
        if grow:
            admin.create_partitions(grow)
        _wait_topics_visible(admin, topics)
    finally:
        admin.close()


def _wait_topics_visible(admin: KafkaAdminClient, topics: dict[str, int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        descs = admin.describe_topics(list(topics))
        ready = {d["name"] for d in descs
                 if d.get("error_code", 0) == 0 and len(d["partitions"]) >= topics[d["name"]]
                 and all(p.get("leader_id", -1) >= 0 for p in d["partitions"])}
        if ready >= set(topics):
            return
        if time.monotonic() > deadline:
            raise StreamError(f"topics not ready after {timeout_s}s: {sorted(set(topics) - ready)}")
        time.sleep(0.05)


async def ensure_topics(cfg: KafkaConfig, topics: dict[str, int]) -> None:
    """Create missing topics with their partition counts (and grow existing ones); waits until usable."""
    check_files(cfg)
    try:
        await anyio.to_thread.run_sync(_ensure_topics_sync, cfg, topics)
    except KafkaError as exc:
        names = sorted(topics)
        shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        raise _connect_error(f"could not create topics ({shown}) on", cfg, exc) from exc


# -- producer ---------------------------------------------------------------------------------------
