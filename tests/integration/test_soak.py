"""A short soak (`rollout loadtest soak`'s body): 50 sandbox sessions for 30 s through a separate
`rollout run --role sandbox` process with Kafka in the loop; nothing may leak.

The soak starts its own broker and nats-server (free ports, stopped by pid) so that it measures one
process it fully owns; figures are asserted only where they are exact (leaks), never timings.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.integration]

SOAK = Path(__file__).resolve().parents[2] / "loadtests" / "soak.py"


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loadtests.soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_short_soak_leaks_nothing() -> None:
    soak = load_soak()
    figures = soak.run(duration_s=30, sessions=50)
    print(soak.table(figures))
    assert figures["cycles"] > 50 and figures["verifications"] > 0
    assert figures["errors"] == 0, figures["error_kinds"]
    assert figures["exit_code"] == 0  # drained cleanly on SIGTERM
    assert figures["leaked_processes"] == 0
    assert figures["leaked_mounts"] == figures["leaked_cgroups"] == figures["leaked_owner_files"] == 0
    # both quiescent points hold the pool's sandboxes (idle) and nothing else: the fd count comes back
    assert abs(figures["leaked_fds"]) <= 8, figures
    # 30 s is too short to bound RSS growth at 5% reliably (allocator warm-up); the soak command does
    assert figures["rss_growth_fraction"] < 0.25, figures
