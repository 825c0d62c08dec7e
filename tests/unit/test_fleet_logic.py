"""Pure logic of the simulated-fleet benchmark: its statistics, CPU accounting and the sim's token scale."""

from __future__ import annotations

import asyncio
import os

import pytest

from actors.inference.local.protocol import SamplingParams
from actors.inference.sim.engine import SimEngine
from actors.inference.sim.roofline import Roofline
from loadtests.fleet import cpu_seconds_from_stat, process_cpu_s, ratio_stats, us_per_sample

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
