"""``loadtests/weights.py --quick`` runs end to end as its own process (as it is run) against the
session's nats-server. Its timings are not judged (tests never assert them), only that each path ran
and that the JSON carries the keys the docs quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(300)]

HEADLINE = ("sync_seconds_fp32", "sync_seconds_bf16", "publish_mbps", "fetch_mbps", "raw_put_mbps", "raw_get_mbps",
            "adapter_vs_raw")


def test_weights_loadtest_quick_syncs_both_dtypes_and_the_raw_path(nats_url: str, tmp_path: Path) -> None:
    out_path = tmp_path / "weights.json"
    proc = subprocess.run([sys.executable, "-m", "loadtests.weights", "--quick", "--nats", nats_url,
                           "--json", str(out_path)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(out_path.read_text())
    assert all(isinstance(out[k], float) and out[k] > 0 for k in HEADLINE), out
    # bf16 on the wire is half the bytes of float32 (config.json aside)
    assert 0.45 < out["wire_mb_bf16"] / out["wire_mb_fp32"] < 0.55
    for dtype in ("fp32", "bf16"):
        assert all(out[f"{phase}_seconds_{dtype}"] > 0 for phase in ("write", "publish", "fetch", "apply"))
    assert "adapter bfloat16" in proc.stdout and "raw nats-py float32" in proc.stdout
