"""``loadtests/multidomain.py --quick`` runs end to end as its own process, as it is run: the tiny char model
trains the char domains at once under both engine systems, the one evaluator scores the base model and every
run's weights per domain, and the JSON has the shape the docs and the issue quote. Every domain must reach the
learner (at least one trained sample per domain and system); speeds and accuracies are not judged here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests import multidomain

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(900)]


def test_quick_multidomain_benchmark_trains_every_domain_and_scores_each(kafka_bootstrap: str, nats_url: str,
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "multidomain.json"
    proc = subprocess.run([sys.executable, "-m", "loadtests.multidomain", "--quick", "--bootstrap", kafka_bootstrap,
                           "--nats", nats_url, "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"seconds_budget", "seeds", "domains_trained", "mean_gain", "worst_gain", "domains_up", "domains_down",
            "adaptive_minus_static_mean_gain", "engine_only_domains", "png", "systems", "domains"} <= set(result)
    domains = list(multidomain.QUICK_DOMAINS)
    assert result["domains_trained"] == len(domains) and list(result["domains"]) == domains
    assert result["engine_only_domains"] == [d for d in domains if d == "terminal"]  # the multi-turn one
    assert list(result["systems"]) == list(multidomain.ENGINE_SYSTEMS)
    for system, s in result["systems"].items():
        assert s["status"] == "ok", (system, s)
        (run,) = s["runs"].values()  # one seed
        assert run["steps"] >= 1 and run["samples_trained"] >= run["steps"], (system, run)
        assert sum(run["domain_samples"].values()) == run["samples_trained"], (system, run)
        assert run["sampling_shares"], (system, "the scheduler's status was never read")
        assert {"mean_gain", "worst_gain", "domains_up", "domains_down"} <= set(s)
    for d, fig in result["domains"].items():
        assert fig["trained"] and fig["episodes"] >= 1 and 0.0 <= fig["before"] <= 1.0, (d, fig)
        assert 0.0 <= fig["constant_baseline"] <= 1.0
        for system in multidomain.ENGINE_SYSTEMS:
            row = fig["systems"][system]
            assert row["samples_trained"] >= 1, (d, system, "the domain trained no sample")
            assert 0.0 <= row["after"] <= 1.0 and row["gain"] == pytest.approx(row["after"] - fig["before"], abs=2e-4)
            lo, hi = row["gain_ci95"]
            assert lo <= row["gain"] <= hi
    assert result["mean_gain"] == result["systems"]["engine_adaptive"]["mean_gain"]
    assert Path(result["png"]).read_bytes()[:4] == b"\x89PNG"
    assert "mean gain" in proc.stdout and "engine_adaptive" in proc.stdout


def test_the_trl_reward_is_the_engines_verifier_and_reward_with_code_in_a_sandbox() -> None:
    """TRL's reward function (``loadtests/_trl_multidomain.py``) gives each domain's ideal answer the engine's
    full reward and a wrong one none, code run in a real bwrap sandbox; conversational and plain completions alike."""
    import random

    from domains import DOMAINS
    from loadtests._trl_multidomain import engine_rewards

    names = ["arith", "code", "math"]
    tasks = [(n, DOMAINS[n].make(random.Random(5), 0.0)) for n in names]
    domains = [n for n, _ in tasks]
    specs = [json.dumps(t.spec) for _, t in tasks]
    with engine_rewards(names) as reward:
        assert reward([[{"role": "assistant", "content": t.ideal}] for _, t in tasks], domains, specs) == [1.0, 1.0, 1.0]
        assert reward([t.ideal for _, t in tasks], domains, specs) == [1.0, 1.0, 1.0]
        assert reward(["def f(x): return None", "def f(x): return None", "-12345"], domains, specs) == [0.0, 0.0, 0.0]
