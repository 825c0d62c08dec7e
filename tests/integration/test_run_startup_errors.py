"""`rollout run` start-up failures: one line ``rollout run: ...`` naming what failed and with which settings,
exit code 1, no traceback (``--debug`` prints it); a bad model directory is reported without waiting out the
inference server's start-up timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.infra.process import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def rollout_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ops.cli", "run", "--run-dir", str(tmp_path / "run"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=200,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def failure_line(done: subprocess.CompletedProcess[str], returncode: int = 1) -> str:
    """The one line a failed start-up prints; every other stderr line must be a JSON log record.

    ``returncode``: 1 for what failed while starting, 2 for a config refused before anything started."""
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    plain = [ln for ln in lines if not _is_json(ln)]
    assert done.returncode == returncode, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(plain) == 1 and plain[0] == lines[-1], done.stderr[-3000:]
    assert plain[0].startswith("rollout run: ")
    return plain[0]


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_kafka_down_is_one_line_naming_the_broker_and_the_settings(tmp_path: Path, unique_name: str) -> None:
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {"ROLLOUT__KAFKA__BOOTSTRAP": bootstrap, "ROLLOUT__NAMESPACE": unique_name}
    line = failure_line(rollout_run(tmp_path, "--role", "reward", **env))
    assert bootstrap in line and "kafka.security_protocol=PLAINTEXT" in line
    assert "KafkaTimeoutError: KafkaTimeoutError" not in line and ": None" not in line


LLAMA_CONFIG = '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048}'


@pytest.mark.parametrize("layout,why", [
    (None, "model directory does not exist"),
    ({"config.json": "{}"}, "names no architectures"),
    ({"config.json": LLAMA_CONFIG}, "no weights"),
    ({"config.json": LLAMA_CONFIG, "model.safetensors": "x"}, "tokenizer files are missing"),
])
def test_a_model_dir_missing_files_is_refused_before_anything_starts(tmp_path: Path, layout, why) -> None:
    model_dir = tmp_path / "model"
    if layout is not None:
        model_dir.mkdir()
        for name, text in layout.items():
            (model_dir / name).write_text(text)
    # Kafka is not even needed: the directory is checked with the config, before any connection
    env = {"ROLLOUT__INFERENCE__MODEL_DIR": str(model_dir), "ROLLOUT__KAFKA__BOOTSTRAP": f"127.0.0.1:{free_port()}"}
    line = failure_line(rollout_run(tmp_path, "--role", "inference", **env), returncode=2)
    assert "inference.model_dir" in line and str(model_dir) in line and why in line


def test_a_model_that_fails_to_load_ends_the_start_up_wait(tmp_path: Path, kafka_bootstrap: str, nats_url: str,
                                                           unique_name: str) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(LLAMA_CONFIG)
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    (model_dir / "tokenizer.json").write_text("{}")
    done = rollout_run(tmp_path, "--role", "inference", ROLLOUT__INFERENCE__MODEL_DIR=str(model_dir),
                       ROLLOUT__KAFKA__BOOTSTRAP=kafka_bootstrap, ROLLOUT__NATS__URL=nats_url,
                       ROLLOUT__NAMESPACE=unique_name)
    line = failure_line(done)
    # the directory passes the file checks; the server process exited on the load error, and the wait did
    # not run into its start-up timeout
    assert f"local inference server for {model_dir} exited with code 1 during start-up" in line
    assert "model load failed" in line and "not healthy after" not in line
    log = tmp_path / "run" / "logs" / "inference-server.log"
    assert f"(log: {log})" in line and "model load failed" in log.read_text()

    debug = rollout_run(tmp_path, "--role", "inference", "--debug", ROLLOUT__INFERENCE__MODEL_DIR=str(model_dir),
                        ROLLOUT__KAFKA__BOOTSTRAP=kafka_bootstrap, ROLLOUT__NATS__URL=nats_url,
                        ROLLOUT__NAMESPACE=unique_name)  # the same failure, its traceback first
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert f"local inference server for {model_dir} exited with code 1 during start-up" in debug.stderr.strip().splitlines()[-1]
