"""Backpressure: once the learner stops, admission stops at the off-policy bound and no process grows.

Every role runs as its own ``rollout run --role R`` daemon on a broker and nats-server private to this
test; the learner exits after ``max_steps``, so its version freezes and the scheduler must stop at
``(max_staleness + version + 1) * batch_size`` (+ filtered) admitted samples. Each process's RSS
(``/proc/<pid>/status`` VmRSS) is sampled while the pipeline sits at the bound and must stay flat.
The long version: ``loadtests/backpressure.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.backpressure import Plan, run

pytestmark = [pytest.mark.timeout(360)]


def test_a_stopped_learner_throttles_admission_and_memory_stays_flat(tmp_path: Path):
    plan = Plan(duration_s=20.0, sample_every_s=1.0, max_steps=1)
    results = run(plan, tmp_path, log=print)
    print({k: v for k, v in results.items() if not k.startswith("_")})
    assert results["admitted_samples"] <= results["admission_bound"]
    assert results["admitted_after_stop"] == 0
    assert results["blocked_waits"] > 0
    assert results["rss_flat"], results["_rows"]
