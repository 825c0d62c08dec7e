"""The weights canary: a server that reports a version without serving its weights trips it.

The local server runs in this process (tiny model, re-scoring on); the learner trains a step, and the
update is blocked: the server is told the new version number (``/update_weight_version``) but keeps its
old weights. The probe's log-probs then differ from the learner's under that version and the canary trips;
with the update applied (``/update_weights_from_disk``) it passes with a gap of at most 1e-6.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from actors.learner import probe_server, save_weights
from engine.config import LearnerConfig
from engine.schemas import Experience
from learning import canary
from learning.core import Learner, score_tokens
from modelserver.client import SGLangClient
from modelserver.llm import load_model_dir, write_tiny_model_dir
from modelserver.local.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(120)

CFG = LearnerConfig(batch_size=2, lr=0.05, canary_threshold=1e-3, canary_max_lag_s=30.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(model directory, URL) of a re-scoring local server at weight version 0."""
    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    server = TestServer(build_app(ServerConfig(model_dir=model_dir, max_batch=4, chunk_size=64, weight_version="0",
                                               rescore=score_tokens)), port=0)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    client = SGLangClient([url])
    try:
        await client.wait_healthy(timeout=60)
        yield model_dir, url
    finally:
        await client.aclose()
        await server.close()


def _train_one_step(learner: Learner) -> None:
    """One real optimizer step and the publication that follows it (version 0 -> 1)."""
    rng = np.random.default_rng(0)
    for i in range(CFG.batch_size):
        n = 6
        learner.offer(Experience(sample_id=f"s{i}", task_id="t", domain="d",
                                 prompt_ids=np.asarray([5, 6, 7], np.int32),
                                 response_ids=rng.integers(10, 60, size=n).astype(np.int32),
                                 logprobs=np.full(n, -3.0, np.float32), loss_mask=np.ones(n, np.uint8),
                                 weight_versions=np.zeros(n, np.int32), reward=1.0, advantage=1.0 - 2 * i,
                                 group_size=2))
    report = learner.step()
    assert report.publish and learner.version == 1


async def _probe(url: str, learner: Learner, tokenizer: Any, published_at: dict[int, float]) -> canary.Verdict:
    return await probe_server(url, learner, tokenizer, CFG, published_at)


@pytest.mark.anyio
async def test_canary_passes_when_the_server_serves_the_learners_weights(served, tmp_path: Path) -> None:
    model_dir, url = served
    model, tokenizer = load_model_dir(model_dir)
    learner = Learner(model, CFG, max_staleness=4)
    before = await _probe(url, learner, tokenizer, {0: 0.0})
    assert before.ok and before.compared and before.gap is not None and before.gap <= 1e-6, before
    _train_one_step(learner)
    save_weights(learner.model, tmp_path / "v1", tokenizer=tokenizer)
    client = SGLangClient([url])
    try:
        await client.update_weights_from_disk(str(tmp_path / "v1"), weight_version="1")
    finally:
        await client.aclose()
    after = await _probe(url, learner, tokenizer, {1: 0.0})
    assert after.ok and after.compared and after.gap is not None and after.gap <= 1e-6, after


@pytest.mark.anyio
async def test_canary_trips_when_a_weight_update_is_blocked(served) -> None:
    model_dir, url = served
    model, tokenizer = load_model_dir(model_dir)
    learner = Learner(model, CFG, max_staleness=4)
    _train_one_step(learner)
    client = SGLangClient([url])
    try:  # the update is blocked: the server reports version 1 and keeps version 0's weights
        await client.update_weight_version("1")
    finally:
        await client.aclose()
    verdict = await _probe(url, learner, tokenizer, {1: 0.0})
    assert not verdict.ok and verdict.compared, verdict
    assert verdict.gap is not None and verdict.gap > CFG.canary_threshold
    assert "claims weight version 1 but its probe log-probs differ" in verdict.reason


def test_a_server_that_never_catches_up_trips_after_the_lag_bound() -> None:
    common: dict[str, Any] = dict(url="u", learner_version=3, comparable=False, server_logprobs=[-1.0],
                                  learner_logprobs=None, threshold=1e-3, max_lag_s=30.0)
    assert canary.judge(claimed=2, lag_s=5.0, **common).ok  # still catching up
    late = canary.judge(claimed=2, lag_s=31.0, **common)
    assert not late.ok and "still serves weight version 2 31s after version 3" in late.reason
    assert not canary.judge(claimed=4, lag_s=None, **common).ok  # a version never published


def test_the_gap_is_relative_to_the_logprob() -> None:
    assert canary.relative_gap([-10.0], [-10.00001]) == pytest.approx(1e-6, rel=1e-3)
    assert canary.relative_gap([-0.5], [-0.5000005]) == pytest.approx(5e-7, rel=1e-3)
    assert canary.relative_gap([-1.0, -2.0], [-1.0]) == float("inf")


@pytest.mark.anyio
async def test_the_learner_role_says_so_loudly_and_stops_when_configured(served, caplog) -> None:
    """The role's canary after a publication: error log, counters, status, and with ``canary_action = "stop"``
    the learner fails (CanaryTripped)."""
    import json

    from actors.learner import CanaryTripped, LearnerActor
    from actors.runtime import Runtime
    from engine.config import EngineConfig, TransportConfig
    from engine.topics import Names

    model_dir, url = served
    model, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(transport=TransportConfig(type="memory"),
                       learner=CFG.model_copy(update={"canary_action": "stop"}))
    async with Runtime(cfg, instance="canary") as rt:
        actor = LearnerActor(rt, model_dir, probe_urls=[url])
        actor.learner, actor.tokenizer = Learner(model, cfg.learner, max_staleness=4), tokenizer
        _train_one_step(actor.learner)
        actor._published_at[1] = 0.0
        client = SGLangClient([url])
        try:
            await client.update_weight_version("1")  # blocked: the old weights stay
        finally:
            await client.aclose()
        with pytest.raises(CanaryTripped, match="claims weight version 1"):
            await actor._canary()
        assert actor.canary_trips == 1 and actor.statistics()["canary_trips"] == 1
        assert any("CANARY TRIPPED" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
        status = json.loads(await rt.require_control().kv_get(rt.kv_bucket, Names.LEARNER_VERSION_KEY) or b"{}")
        assert status["canary"]["trips"] == 1 and "claims weight version 1" in status["canary"]["tripped"]
