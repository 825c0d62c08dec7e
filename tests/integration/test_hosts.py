"""Hosts that fail: the quick mode of ``python -m loadtests.hosts`` loses nothing and leaves nothing behind.

Three network-namespace hosts (Kafka + NATS + scheduler + learner on one; an inference, a sandbox and a
reward daemon on each of the other two), host 2 killed whole mid-run and brought back; the exactly-once
ledger must account for every sample once, and the namespaces and links the run made must be gone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loadtests.hosts import FAILED_HOST, quick_plan, run

pytestmark = [pytest.mark.timeout(420)]


def test_a_whole_host_killed_mid_run_loses_nothing_and_its_namespaces_are_removed(tmp_path: Path) -> None:
    results = run(quick_plan(seed=1), tmp_path, log=print)
    print(results["table"])
    assert results["samples_lost"] == 0, results["fates"]
    assert results["samples_trained_twice"] == 0
    assert results["tasks_admitted"] >= 12 and results["checkpoint_agrees"], results["table"]
    (kill,) = results["host_kills"]
    assert kill["host"].endswith(f"-{FAILED_HOST}") and kill["pids"] >= 3
    # every daemon of the failed host was started again; the others never were
    assert all(n == (2 if name.endswith(f"-h{FAILED_HOST}") else 1) for name, n in results["starts"].items()), \
        results["starts"]
    assert results["replicas"] == {"inference": 2, "sandbox": 2, "reward": 2}
    assert results["netns_left"] == []
    tag = kill["host"].rsplit("-", 1)[0]
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
