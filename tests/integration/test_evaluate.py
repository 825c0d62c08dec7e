"""Held-out evaluation against a real local server and bwrap sandboxes: greedy and sampled (seeded)
accuracy, single-turn and multi-turn domains."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from actors.evaluate import evaluate
from modelserver.launch import LocalServer
from ops.demo import DemoPlan, warm_start

pytestmark = pytest.mark.anyio

DOMAINS = {"arith": 6, "terminal": 3}


async def test_sampled_evaluation_is_seeded_and_counts_every_generation(tmp_path) -> None:
    plan = dataclasses.replace(DemoPlan(), sft_examples=300, sft_steps=30)
    await anyio.to_thread.run_sync(warm_start, tmp_path / "model", plan)
    async with LocalServer(tmp_path / "model", log_path=tmp_path / "server.log") as url:
        greedy = await evaluate(url, DOMAINS)
        sampled = await evaluate(url, DOMAINS, samples=3, temperature=1.0, seed=5)
        again = await evaluate(url, DOMAINS, samples=3, temperature=1.0, seed=5)
        with pytest.raises(ValueError, match="temperature"):
            await evaluate(url, DOMAINS, samples=2)
        with pytest.raises(ValueError, match="samples"):
            await evaluate(url, DOMAINS, samples=0, temperature=1.0)
    assert {d: (s.tasks, s.samples) for d, s in greedy.items()} == {"arith": (6, 1), "terminal": (3, 1)}
    assert {d: (s.tasks, s.samples) for d, s in sampled.items()} == {"arith": (6, 3), "terminal": (3, 3)}
    # the same seed draws the same generations, multi-turn episodes included
    assert sampled == again
    for scores in (greedy, sampled):
        assert scores["terminal"].solved <= scores["terminal"].accuracy  # partial credit counts, unsolved
    # arith is all or nothing: accuracy = solved, a mean over all 6 x 3 generations
    arith = sampled["arith"]
    assert arith.accuracy == arith.solved
    assert abs(arith.accuracy * 18 - round(arith.accuracy * 18)) < 1e-9
