"""`rollout inference serve --backend sim` as its own process: it listens, generates and reports simulated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _get(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_sim_backend_serves_the_sglang_protocol() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "inference", "serve", "--backend", "sim", "--time-scale", "0.001",
                             "--port", "0", "--weight-version", "w0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        deadline = time.monotonic() + 60
        while True:  # poll until the engine is in place (the app's start-up step)
            try:
                info = _get(url + "/model_info")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        assert info["model_type"] == "simulated" and info["weight_version"] == "w0"
        out = _get(url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 16}, "return_logprob": True})
        assert out["meta_info"]["completion_tokens"] == 16
        assert out["meta_info"]["output_token_weight_versions"] == ["w0"] * 16
        upd = _get(url + "/update_weights_from_disk", {"model_path": "/sim/none", "weight_version": "w1"})
        assert upd["success"] is True
        assert _get(url + "/get_weight_version")["weight_version"] == "w1"
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        assert proc.stderr is not None and proc.stdout is not None
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert "SIMULATED inference server" in err


def test_sim_is_a_registered_backend_a_deployment_can_launch(tmp_path: Path) -> None:
    import anyio

    from modelserver.backends import inference_backend
    from modelserver.client import SGLangClient
    from modelserver.llm import build_char_tokenizer, build_tiny_model, save_model_dir, tiny_config
    from engine.config import InferenceConfig

    tok = build_char_tokenizer()
    model_dir = tmp_path / "model"
    save_model_dir(build_tiny_model(tiny_config(len(tok)), seed=0), tok, model_dir)
    launch = inference_backend("sim").launch
    assert launch is not None

    async def main() -> tuple[dict, str]:
        async with launch(InferenceConfig(backend="sim"), model_dir, tmp_path / "run") as url:
            async with SGLangClient([url], timeout=30) as client:
                result = await client.generate(text="hi", sampling_params={"max_new_tokens": 8})
                info = _get(url + "/model_info")
                return info, result.text
    info, text = anyio.run(main)
    assert info["model_type"] == "simulated"
    assert isinstance(text, str)
    log = (tmp_path / "run" / "logs" / "inference-server.log").read_text()
    assert "SIMULATED inference server" in log
