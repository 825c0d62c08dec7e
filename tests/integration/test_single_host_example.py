"""deploy/examples/single-host.toml runs as shipped: every role in one daemon against this session's broker
and nats-server (their addresses given as ROLLOUT__ environment overrides), one learner step, then a drain
(exit 0); and the daemon, which loads a model and publishes weights, writes only JSON lines on stderr."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "single-host.toml"

pytestmark = pytest.mark.timeout(600)


def status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/status", timeout=10) as resp:
        return json.loads(resp.read())


def test_the_example_loads_as_shipped() -> None:
    cfg = load_config(EXAMPLE, environ={})
    assert sorted(cfg.roles) == ["inference", "learner", "reward", "sandbox", "scheduler"]
    assert (cfg.kafka.bootstrap, cfg.nats.url) == ("127.0.0.1:9092", "nats://127.0.0.1:4222")
    assert (cfg.inference.backend, cfg.sandbox.backend, cfg.inference.model_dir) == ("local", "bwrap", None)
    assert "model_dir = " in EXAMPLE.read_text()  # documented, commented out: the tiny model runs without it


def test_single_host_example_steps_drains_and_logs_only_json(kafka_bootstrap: str, nats_url: str,
                                                             unique_name: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ROLLOUT__KAFKA__BOOTSTRAP": kafka_bootstrap,
        "ROLLOUT__NATS__URL": nats_url,
        "ROLLOUT__NAMESPACE": unique_name,
        "ROLLOUT__TELEMETRY__HTTP_PORT": "0",  # 9100 may be taken on a shared machine
        "ROLLOUT__LEARNER__CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        # the tiny untrained model scores 0 on every sample: keep its zero-variance groups, or no step comes
        "ROLLOUT__REWARD__DROP_ZERO_VARIANCE": "false",
        "ROLLOUT__INFERENCE__MAX_NEW_TOKENS": "8",
    }
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "run", "--config", str(EXAMPLE), "--run-dir",
                                 str(tmp_path / "run")], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until wired (or EOF if it died)
        assert line, stderr_path.read_text()[-3000:]
        ready = json.loads(line)
        assert ready["event"] == "ready" and ready["namespace"] == unique_name
        deadline = time.monotonic() + 420
        learner: dict[str, Any] = {}
        while learner.get("step", 0) < 1:
            assert proc.poll() is None, stderr_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no learner step: {learner}"
            learner = status(ready["http"]).get("learner", {})
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, stderr_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    assert learner["published_version"] is not None  # it loaded the model and published weights
    lines = [ln for ln in stderr_path.read_text().splitlines() if ln.strip()]
    assert lines, "the daemon logged nothing"
    not_json = []
    for ln in lines:
        try:
            assert isinstance(json.loads(ln), dict)
        except (ValueError, AssertionError):
            not_json.append(ln)
    assert not_json == [], f"{len(not_json)} of {len(lines)} stderr lines are not JSON: {not_json[:10]}"
