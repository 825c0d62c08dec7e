"""``loadtests/learning.py --quick`` runs end to end as its own process, as it is run: every system it
runs trains at least one step on the real model, its weights are scored by the one held-out evaluation,
and the JSON carries what the docs quote. Speeds and accuracies are not judged here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(1800)]


def real_model_dir() -> str:
    """SmolLM2-135M-Instruct: ``ROLLOUT_MODEL_DIR`` or the model cache (``rollout model prepare smollm2-135m``)."""
    if os.environ.get("ROLLOUT_MODEL_DIR"):
        return os.environ["ROLLOUT_MODEL_DIR"]
    try:
        from modelserver.prepare import cached_model_dir  # type: ignore[import-not-found]
    except ImportError:
        cached_model_dir = None
    path = cached_model_dir("smollm2-135m") if cached_model_dir is not None else None
    if path is None or not Path(path).is_dir():
        pytest.fail("the real model is missing: run `rollout model prepare smollm2-135m` or set ROLLOUT_MODEL_DIR")
    return str(path)


def test_quick_learning_benchmark_trains_every_system_and_scores_them(kafka_bootstrap: str, nats_url: str,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "learning.json"
    # TRL is an optional extra (its row is tested by the unit tests); the suite runs the two that are always there
    proc = subprocess.run([sys.executable, "-m", "loadtests.learning", "--quick", "--eval-tasks", "8",
                           "--only", "engine,minimal",
                           "--model-dir", real_model_dir(), "--bootstrap", kafka_bootstrap, "--nats", nats_url,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"seconds_budget", "infra_seconds", "engine_over_minimal", "engine_over_trl", "eval_tasks", "png",
            "systems"} <= set(result)
    systems = result["systems"]
    assert list(systems) == ["engine", "minimal"]
    assert systems["engine"]["status"] == "ok" and systems["minimal"]["status"] == "ok", proc.stdout[-3000:]
    ran = {name: s for name, s in systems.items() if s["status"] == "ok"}
    for name, s in ran.items():
        assert s["steps"] >= 1 and s["samples_trained"] >= s["steps"], (name, s)
        assert 0.0 <= s["heldout_before"] <= 1.0 and 0.0 <= s["heldout_after"] <= 1.0, (name, s)
        assert s["peak_rss_mb"] > 0 and s["seconds"] > 0 and len(s["curve"]) >= 1, (name, s)
    assert len({s["heldout_before"] for s in ran.values()}) == 1  # one evaluation of one base model
    minimal_after = systems["minimal"]["heldout_after"]
    assert result["engine_over_minimal"] == (round(systems["engine"]["heldout_after"] / minimal_after, 3)
                                             if minimal_after else None)
    assert result["engine_over_trl"] is None
    assert Path(result["png"]).read_bytes()[:4] == b"\x89PNG"
    assert "held-out before" in proc.stdout and "engine_over_minimal" in proc.stdout
