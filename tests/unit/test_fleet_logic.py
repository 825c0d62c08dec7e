"""Pure logic of the simulated-fleet benchmark: its statistics, CPU accounting and the sim's token scale."""

from __future__ import annotations

import asyncio
import os

import pytest

from modelserver.local.protocol import SamplingParams
from modelserver.sim.engine import SimEngine
from modelserver.sim.roofline import Roofline
from loadtests.fleet import (
    StalenessPlan,
    cpu_seconds_from_stat,
    draw_group,
    ks_distance,
    process_cpu_s,
    ratio_stats,
    simulate_staleness,
    us_per_sample,
)

pytestmark = pytest.mark.timeout(60)


def test_ratio_stats_per_round_mean_and_interval() -> None:
    out = ratio_stats([30.0, 40.0, 36.0], [10.0, 10.0, 12.0])
    assert out["per_round"] == [3.0, 4.0, 3.0]
    assert out["mean"] == pytest.approx(3.333, abs=1e-3)
    lo, hi = out["ci95"]
    assert lo < out["mean"] < hi
    assert ratio_stats([20.0], [10.0])["ci95"] is None  # one round: no interval
    with pytest.raises(ValueError, match="as many sync as async"):
        ratio_stats([1.0, 2.0], [1.0])


def test_us_per_sample() -> None:
    assert us_per_sample({"reward": 0.5, "learner": 2.0}, 1000) == {"reward": 500.0, "learner": 2000.0}
    assert us_per_sample({"reward": 0.5}, 0) == {"reward": None}


def test_cpu_seconds_from_stat_reads_fields_14_to_17_after_an_awkward_name() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    line = "42 (a) b (c)) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 30 20 20 0 1 0 5 0 0\n"
    assert cpu_seconds_from_stat(line, ticks_per_s=100) == pytest.approx(3.5)


def test_process_cpu_grows_with_work_and_is_zero_for_no_process() -> None:
    before = process_cpu_s(os.getpid())
    x = 0
    while process_cpu_s(os.getpid()) - before < 0.05:  # CPU time, not wall time
        x += sum(range(10_000))
    assert process_cpu_s(os.getpid()) > before
    assert process_cpu_s(2**22 + 12345) == 0.0


def _simulated_seconds(token_scale: int, new_tokens: int, prompt: int) -> float:
    async def main() -> float:
        engine = SimEngine(Roofline(), time_scale=0.0, token_scale=token_scale)
        await engine.start()
        try:
            seq = engine.submit([7] * prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            while not seq.finished:
                await seq.wait_changed()
            assert len(seq.output_ids) == new_tokens
            return engine.simulated_seconds
        finally:
            await engine.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("k", [1, 4])
def test_sim_token_scale_steps_take_k_real_decode_steps_at_the_real_kv_length(k: int) -> None:
    r, prompt, n = Roofline(), 5, 10
    expected = r.prefill_s(prompt) + sum(k * r.decode_step_s(prompt + k * i + (k - 1) // 2) for i in range(n))
    assert _simulated_seconds(k, n, prompt) == pytest.approx(expected)


def test_sim_token_scale_divides_the_sampled_length() -> None:
    async def main() -> tuple[int, int]:
        out = []
        for k in (1, 8):
            engine = SimEngine(time_scale=0.0, token_scale=k, seed=3)
            await engine.start()
            seq = engine.submit([7] * 4, SamplingParams(max_new_tokens=100_000))
            while not seq.finished:
                await seq.wait_changed()
            await engine.aclose()
            out.append(len(seq.output_ids))
        return out[0], out[1]

    real, scaled = asyncio.run(main())
    assert scaled == -(-real // 8)
    with pytest.raises(ValueError, match="token_scale"):
        SimEngine(token_scale=0)


# -- sandbox growth (loadtests/_sandbox_fleet.py) ----------------------------------------------------

def test_sandbox_growth_memory_floor_is_2_gib_or_a_tenth_of_ram() -> None:
    from loadtests._sandbox_fleet import memory_floor_mb

    assert memory_floor_mb(8 * 1024) == 2048.0
    assert memory_floor_mb(64 * 1024) == pytest.approx(6553.6)


@pytest.mark.parametrize(("avail", "pending", "fds", "procs", "why"), [
    (20_000, 0, 100, 300, None),
    (20_000, 1_500, 100, 300, "memory"),   # 1,500 still starting x 12 MB would cross the floor
    (20_000, 0, 18_000, 300, "fds"),
    (20_000, 0, 100, 28_000, "pids"),
])
def test_sandbox_growth_guard_names_the_limit(monkeypatch: pytest.MonkeyPatch, avail: float, pending: int,
                                              fds: int, procs: int, why: str | None) -> None:
    from loadtests import _sandbox_fleet as sf

    monkeypatch.setattr(sf, "meminfo_mb", lambda: {"MemTotal": 24_000.0, "MemAvailable": avail})
    monkeypatch.setattr(sf, "fd_count", lambda pid: fds)
    monkeypatch.setattr(sf, "nofile_soft", lambda pid: 20_000)
    monkeypatch.setattr(sf, "host_processes", lambda: procs)
    monkeypatch.setattr(sf, "pid_max", lambda: 32_768)
    reason = sf.Guard(floor_mb=2_400.0).check(64, pending, role_pid=1)
    assert (reason is None) if why is None else (reason is not None and reason.startswith(why))


def test_sandbox_growth_counts_role_log_warnings(tmp_path: os.PathLike[str]) -> None:
    from pathlib import Path

    from loadtests._sandbox_fleet import log_warnings

    log = Path(tmp_path) / "sandbox.log"
    log.write_text("x INFO fine\nx WARNING reset of sbx-1 failed\nx WARNING reset of sbx-1 failed\nx ERROR boom\n")
    assert log_warnings(log) == {"reset of sbx-1 failed": 2, "boom": 1}
    assert log_warnings(Path(tmp_path) / "missing.log") == {}


def test_sandbox_growth_workload_program_holds_for_the_stated_time() -> None:
    from loadtests._sandbox_fleet import GROUP, completion
    from sandboxes.verifiers import extract_program

    c = completion("t1", GROUP - 1, 20.0, 80.0)
    assert "time.sleep(20.0)" in extract_program(c.text)
    assert (c.domain, c.group_size, c.spec["timeout_s"], len(c.spec["tests"])) == ("code", GROUP, 80.0, 1)


# -- staleness policies ------------------------------------------------------------------------------

def test_ks_distance_of_known_samples() -> None:
    assert ks_distance([1, 2, 3, 4], [4, 3, 2, 1]) == 0.0
    assert ks_distance([1, 2, 3, 4], [3, 4, 5, 6]) == pytest.approx(0.5)  # F_a(2) = 0.5, F_b(2) = 0
    assert ks_distance([1, 2], [5, 6]) == 1.0
    # weights on b: [1, 2] weighted 3:1 has F(1) = 0.75 against a's 0.5
    assert ks_distance([1, 2], [1, 2], [3.0, 1.0]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="two non-empty samples"):
        ks_distance([], [1])
    with pytest.raises(ValueError, match="one non-negative weight per value"):
        ks_distance([1], [1, 2], [1.0])


def test_draw_group_is_fixed_by_seed_and_index() -> None:
    lengths, rewards = draw_group(0, 7, 8)
    assert (lengths, rewards) == draw_group(0, 7, 8) and lengths != draw_group(0, 8, 8)[0]
    assert len(lengths) == len(rewards) == 8 and set(rewards) <= {0.0, 1.0}
    assert all(1 <= n <= 16384 for n in lengths)


def test_staleness_simulation_drop_discards_and_downweight_trains_every_judged_sample() -> None:
    plan = StalenessPlan(trained_target=192, servers=2, batch_size=16, group_size=4, staleness=1, token_scale=128)
    drop, keep = simulate_staleness("drop", plan), simulate_staleness("downweight", plan)
    for row in (drop, keep):
        assert row["trained"] >= plan.trained_target and row["steps"] >= 2  # a step takes all pending samples
        assert row["judged"] == row["trained"] + row["dropped_stale"]
        assert 0.0 <= row["length_ks_zero_variance"] <= 1.0
    assert drop["stale_trained"] == 0 and drop["length_ks"] == drop["length_ks_weighted"]
    assert keep["dropped_stale"] == 0 and keep["length_ks"] == 0.0  # trained == judged, by construction
    assert keep["stale_trained"] > 0  # at staleness 1 some long samples outlive the bound: trained, downweighted
    with pytest.raises(ValueError, match="staleness policy 'keep' is not one of drop, downweight"):
        simulate_staleness("keep", plan)

