"""The transport conformance checks (tests/transport_conformance.py) on Kafka, the production event log."""

from __future__ import annotations

import pytest

from engine.config import KafkaConfig
from streams.transports import KafkaEventLog
from tests.transport_conformance import CHECKS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
async def test_kafka_passes_the_transport_conformance_checks(check, kafka_bootstrap: str, unique_name: str) -> None:  # type: ignore[no-untyped-def]
    await check(KafkaEventLog(KafkaConfig(bootstrap=kafka_bootstrap)), unique_name)
