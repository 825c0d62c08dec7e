"""The tracing benchmark's comparison: each 'on' phase against the 'off' phases either side."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "loadtests" / "tracing_overhead.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("loadtests_tracing_overhead", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def rows(values: list[float]) -> list[dict]:
    return [{"mode": "off" if i % 2 == 0 else "on", "samples_per_s": v, "cost": 1000 / v}
            for i, v in enumerate(values)]


def test_a_steady_drift_is_not_taken_for_overhead() -> None:
    bench = load_bench()
    drifting = rows([100.0, 98.0, 96.0, 94.0, 92.0])  # 2% slower each phase, tracing costs nothing
    assert bench.bracketed(drifting, "samples_per_s", higher_is_better=True) == pytest.approx([0.0, 0.0])
    # plain alternation (each on phase against the off phase before it) would have said 2%
    assert 1 - drifting[1]["samples_per_s"] / drifting[0]["samples_per_s"] == pytest.approx(0.02)


def test_overhead_has_the_sign_of_a_cost_for_throughput_and_for_cpu() -> None:
    bench = load_bench()
    slower_on = rows([100.0, 90.0, 100.0, 95.0, 100.0])
    assert bench.bracketed(slower_on, "samples_per_s", higher_is_better=True) == pytest.approx([0.10, 0.05])
    cpu = bench.bracketed(slower_on, "cost", higher_is_better=False)
    assert cpu == pytest.approx([100 / 90 - 1, 100 / 95 - 1])


def test_alternating_recorders_are_split_and_paired() -> None:
    bench = load_bench()
    # off, on/lean, off, on/sdk, off, on/lean, off, on/sdk, off: lean costs 2%, sdk 6%
    values = [100.0, 98.0, 100.0, 94.0, 100.0, 98.0, 100.0, 94.0, 100.0]
    schedule = [{"mode": "off" if i % 2 == 0 else "on", "tracer": ("lean", "sdk")[(i // 2) % 2],
                 "samples_per_s": v, "cpu_ms_per_sample": 1000 / v, "actors_cpu_ms_per_sample": 500 / v}
                for i, v in enumerate(values)]
    split = bench.split_by_recorder(schedule, ("lean", "sdk"))
    assert split["lean"]["samples_per_s"] == pytest.approx([0.02, 0.02])
    assert split["sdk"]["samples_per_s"] == pytest.approx([0.06, 0.06])
    assert split["sdk"]["cpu_ms_per_sample"] == pytest.approx([100 / 94 - 1] * 2)
    assert bench.paired_differences(split["lean"]["samples_per_s"], split["sdk"]["samples_per_s"]) == \
        pytest.approx([0.04, 0.04])
    assert bench.paired_differences([0.01, 0.02, 0.03], [0.05, 0.05]) == pytest.approx([0.04, 0.03])
