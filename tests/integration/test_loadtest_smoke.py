"""The same-run benchmarks still run end to end: tiny schedules of ``loadtests/tracing_overhead.py`` and
``loadtests/stream_interval.py``, each as its own process (as they are run) against the session's broker
and nats-server, and ``rollout loadtest sandboxes --backend bwrap`` with no Docker engine. Their figures are not judged here (tests never assert timings), only that every phase
ran with the setting it names and that the JSON carries what the docs quote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(300)]


def run_loadtest(script: str, args: list[str], kafka_bootstrap: str, nats_url: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", f"loadtests.{script}", "--bootstrap", kafka_bootstrap,
                           "--nats", nats_url, "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_tracing_overhead_runs_on_the_sdk_recorder(kafka_bootstrap: str, nats_url: str, tmp_path: Path) -> None:
    out = run_loadtest("tracing_overhead", ["--rounds", "2", "--phase-samples", "60", "--clock-phases", "1",
                                            "--no-gc-freeze"],
                       kafka_bootstrap, nats_url, tmp_path / "tracing.json")
    assert out["tracer"] == "sdk"
    assert out["spans_per_sample"] >= 3  # generate, verify, reward per sample, schedule per task
    assert "Tracer.start_span" in out["tracing_by_call"]  # the clock phase timed the SDK's recorder
    assert "by_recorder" not in out and "sdk_minus_lean_overhead" not in out


def test_stream_interval_sends_fewer_token_records(kafka_bootstrap: str, nats_url: str, tmp_path: Path) -> None:
    out = run_loadtest("stream_interval", ["--rounds", "1", "--phase-samples", "60", "--interval", "8"],
                       kafka_bootstrap, nats_url, tmp_path / "interval.json")
    # 24-token samples: a record per streamed chunk at interval 1 (a token each from the local server), at
    # most three at interval 8
    assert out["records_per_sample_interval_n"] <= 3 < out["records_per_sample_interval_1"] <= 24
    assert out["samples_per_phase"] >= 60 and out["speedup"] > 0


def test_sandbox_loadtest_runs_bwrap_without_a_docker_engine(tmp_path: Path) -> None:
    out = tmp_path / "sandboxes.json"
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path / 'no-engine.sock'}"}
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "loadtest", "sandboxes", "--backend", "bwrap",
                           "--concurrency", "1", "--duration", "1", "--open", "2", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "baseline skipped: no Docker engine" in proc.stderr
    figures = json.loads(out.read_text())
    assert figures["docker_run_baseline"].startswith("skipped: no Docker engine")
    assert "speedup_vs_docker_run" in figures and figures["speedup_vs_docker_run"] is None
    assert figures["cycles"] > 0 and figures["failures"] == 0 and figures["open_sandboxes"] == 2
    assert {"phase_pool_start_s", "phase_cycles_s", "phase_open_s"} <= set(figures)
    assert "phase_docker_run_s" not in figures
    for key in ("phase_cycles_s", "phase_open_s"):
        assert key in proc.stdout  # the table prints each phase's time


def test_domain_table_quick_measures_each_domain_beside_its_constant_baseline(tmp_path: Path) -> None:
    out = tmp_path / "domains.json"
    proc = subprocess.run([sys.executable, "-m", "loadtests.domains", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["domains_measured"] == 3 and set(figures["domains"]) == {"arith", "code", "terminal"}
    for row in figures["domains"].values():
        assert row["tasks"] == 2 and 0.0 <= row["solved"] <= 1.0 and 0.0 < row["constant_baseline"] <= 1.0
        low, high = row["solved_ci95"]
        assert low <= row["solved"] <= high


def test_fleet_quick_reports_both_staleness_policies(tmp_path: Path) -> None:
    """``loadtests.fleet --quick --staleness-only`` (in-process, no broker): the flat keys the docs quote."""
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, "-m", "loadtests.fleet", "--quick", "--staleness-only", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["simulated"] is True and figures["quick"] is True
    for policy in ("drop", "downweight"):
        for key in ("length_ks", "length_ks_weighted", "length_ks_zero_variance"):
            assert 0.0 <= figures[f"{key}_{policy}"] <= 1.0, key
        assert figures[f"trained_samples_per_s_{policy}"] > 0
    assert [r["policy"] for r in figures["staleness_runs"]] == ["drop", "downweight"]
    assert all(r["trained"] >= 1000 for r in figures["staleness_runs"])  # thousands of samples per side
    assert "SIMULATED staleness policies" in proc.stdout
