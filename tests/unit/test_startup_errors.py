"""Start-up failure messages: one line, saying what failed (no ``KafkaTimeoutError: None``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kafka.errors import KafkaConnectionError, KafkaTimeoutError

from modelserver.launch import LocalServer, LocalServerError
from ops.cli_run import failure_line
from ops.deployment import StartupError
from streams.kafka import StreamError, kafka_reason


def test_kafka_reason_names_the_type_once_and_what_timed_out() -> None:
    assert kafka_reason(KafkaTimeoutError(None), "the produce request") == \
        "KafkaTimeoutError: the produce request timed out"
    assert kafka_reason(KafkaTimeoutError()) == "KafkaTimeoutError: the request timed out"
    assert kafka_reason(KafkaTimeoutError("Unable to bootstrap")) == "KafkaTimeoutError: Unable to bootstrap"
    assert kafka_reason(KafkaConnectionError()) == "KafkaConnectionError"


def test_failure_line_is_one_line_and_unwraps_a_lone_group() -> None:
    assert failure_line(StreamError("could not reach\n  the broker")) == "could not reach the broker"
    assert failure_line(ExceptionGroup("g", [StartupError("inference.model_dir = /x: gone")])) == \
        "inference.model_dir = /x: gone"
    assert failure_line(OSError("disk full")) == "OSError: disk full"
    assert failure_line(KeyError()) == "KeyError"


@pytest.mark.anyio
async def test_local_server_refuses_a_bad_model_dir_before_spawning(tmp_path: Path) -> None:
    """The one model-dir check (modelserver.model_dir.check_model_dir) guards the embedded server."""
    server = LocalServer(tmp_path / "missing", log_path=tmp_path / "log")
    with pytest.raises(LocalServerError, match="model directory does not exist"):
        await server.start()
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(LocalServerError, match="no weights"):
        await LocalServer(d, log_path=tmp_path / "log").start()
    assert server.proc is None and not (tmp_path / "log").exists()  # nothing was spawned


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
