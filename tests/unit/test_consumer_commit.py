"""A commit refused because the group is rebalancing is deferred, not fatal (logic above kafka-python)."""

from __future__ import annotations

from typing import Any

from kafka.errors import RebalanceInProgressError

from engine.config import KafkaConfig
from streams.kafka import Consumer


class FakeClient:
    """Stands for kafka-python's KafkaConsumer: refuses the first ``refusals`` commits."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.committed: list[dict[Any, Any]] = []

    def commit(self, offsets: dict[Any, Any]) -> None:
        if self.refusals:
            self.refusals -= 1
            raise RebalanceInProgressError("the group is rebalancing")
        self.committed.append({(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()})


def test_a_commit_during_a_rebalance_is_deferred_to_the_next_one() -> None:
    consumer = Consumer(KafkaConfig(bootstrap="127.0.0.1:1"), topics=["t"], group="g")
    consumer.assigned = {("t", 0)}
    for offset in range(3):
        consumer._tracker.start(("t", 0), offset)
        consumer._tracker.finish(("t", 0), offset)
    client = FakeClient(refusals=1)
    assert consumer._commit_with(client) == {}  # refused: nothing marked committed
    assert consumer.statistics()["commits_deferred"] == 1 and consumer.commits == 0
    assert consumer._commit_with(client) == {("t", 0): 3}  # the same offsets, on the next commit
    assert client.committed == [{("t", 0): 3}]
