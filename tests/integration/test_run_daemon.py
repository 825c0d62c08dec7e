"""`rollout run` as a real daemon process: ready line, health endpoint, SIGTERM drains and exits 0;
a bad config is refused with the file and the field named."""

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _config(path: Path, namespace: str, bootstrap: str, nats_url: str, run_dir: Path) -> Path:
    path.write_text(f"""
namespace = "{namespace}"
roles = ["sandbox", "reward"]
[kafka]
bootstrap = "{bootstrap}"
default_partitions = 2
[nats]
url = "{nats_url}"
[sandbox]
pool_size = 1
max_sandboxes = 4
[learner]
checkpoint_dir = "{run_dir}/checkpoints"
""")
    return path


def test_run_reports_ready_serves_health_and_drains_on_sigterm(kafka_bootstrap, nats_url, unique_name, tmp_path):
    cfg = _config(tmp_path / "deploy.toml", unique_name, kafka_bootstrap, nats_url, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "run", "--config", str(cfg), "--run-dir",
                             str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())  # blocks until wired (or EOF if it died)
        assert ready["event"] == "ready" and sorted(ready["roles"]) == ["reward", "sandbox"]
        assert ready["http"].startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 30
        while True:  # the actors start right after the ready line: poll until all report alive
            try:
                with urllib.request.urlopen(ready["http"] + "/healthz", timeout=5) as resp:
                    health = json.loads(resp.read())
                    break
            except urllib.error.HTTPError as exc:
                assert time.monotonic() < deadline, f"never healthy: {exc.read()!r}"
                time.sleep(0.1)
        assert health["ok"] and set(health["actors"]) >= {"reward", "sandbox.verify", "sandbox.episodes"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.parametrize("body,field", [("[learner]\nbatch_size = 0\n", "learner.batch_size"),
                                        ("[kafka]\nbootstrapp = 'x'\n", "kafka.bootstrapp"),
                                        ("[inference]\nbackend = 'sglang'\nurls = ['http://sglang:30000']\n",
                                         "inference.model_dir")])
def test_run_refuses_a_bad_config_naming_file_and_field(tmp_path, body, field):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(body)
    done = subprocess.run([sys.executable, "-m", "ops.cli", "run", "--config", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert str(cfg) in done.stderr and field in done.stderr
