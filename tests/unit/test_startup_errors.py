"""Start-up failure messages: one line, saying what failed (no ``KafkaTimeoutError: None``)."""

from __future__ import annotations

from pathlib import Path

from kafka.errors import KafkaConnectionError, KafkaTimeoutError

from actors.inference.launch import model_dir_problems
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


def test_model_dir_problems(tmp_path: Path) -> None:
    assert model_dir_problems(tmp_path / "missing") == ["the directory does not exist"]
    (tmp_path / "file").write_text("")
    assert model_dir_problems(tmp_path / "file") == ["it is not a directory"]
    d = tmp_path / "model"
    d.mkdir()
    assert [p.split(" (")[0] for p in model_dir_problems(d)] == ["no config.json", "no weights", "no tokenizer"]
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json"):
        (d / name).write_text("{}")
    assert model_dir_problems(d) == []
