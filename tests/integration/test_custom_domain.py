"""A domain registered from outside the package, in one call, is verified and rewarded by the real actors.

The domain ``reverse_test`` lives in this module: its generator, its own verifier (which runs the
reference in a sandbox of the verify actor's pool), its reward and format functions. Completions of it
go through ``rollout.completions`` -> VerifyActor (bwrap) -> ``rollout.outcomes`` -> RewardActor ->
``rollout.experience`` on the real broker; nothing else names the domain anywhere.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

from domains import Domain, GeneratedTask, register_domain, unregister_domain
from actors.reward import RewardActor
from actors.runtime import Runtime
from actors.sandbox import SandboxResources, build_sandbox_actors
from engine.actor import RestartPolicy, Supervisor
from engine.config import EngineConfig, KafkaConfig, NatsConfig, RewardConfig, SandboxConfig
from engine.schemas import Completion, Experience, Outcome
from sandboxes import SandboxPool
from streams.kafka import Consumer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NAME = "reverse_test"
REVERSE = "import sys; print(sys.stdin.read().strip()[::-1])"


def make_reverse(rng: random.Random, difficulty: float) -> GeneratedTask:
    word = "".join(rng.choice("abcdef") for _ in range(3 + round(3 * difficulty)))
    return GeneratedTask(prompt=f"reverse {word}:", spec={"word": word}, ideal=f"{word[::-1]}\n")


async def verify_reverse(text: str, spec: dict[str, Any], pool: SandboxPool) -> dict[str, Any]:
    """The reference answer is computed inside a sandbox of the verify actor's pool."""
    async with pool.acquire() as sandbox:
        result = await sandbox.exec(["/usr/bin/python3", "-c", REVERSE], stdin=str(spec["word"]).encode(), timeout=5)
    expected = result.stdout.strip()
    return {"expected": expected, "correct": result.exit_code == 0 and text.strip() == expected}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def reverse_domain() -> Iterator[Domain]:
    domain = register_domain(Domain(NAME, verify_reverse, make_reverse,
                                    reward=lambda facts, text: 1.0 if facts.get("correct") else 0.0,
                                    format_score=lambda text: 1.0 if text.strip().isalpha() else 0.0))
    try:
        yield domain
    finally:
        unregister_domain(NAME)


def completion(task_id: str, index: int, text: str, spec: dict[str, Any]) -> Completion:
    n = 3
    return Completion(
        sample_id=f"{task_id}/{index}", task_id=task_id, domain=NAME, group_index=index, group_size=2,
        prompt_ids=np.arange(4, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
        weight_versions=np.zeros(n, dtype=np.int32), text=text, spec=spec, finish_reason="stop")


@pytest.mark.anyio
async def test_a_domain_registered_once_is_verified_and_rewarded(
        kafka_bootstrap: str, nats_url: str, unique_name: str, reverse_domain: Domain) -> None:
    cfg = EngineConfig(
        namespace=unique_name,
        kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
        nats=NatsConfig(url=nats_url),
        sandbox=SandboxConfig(backend="bwrap", pool_size=1, max_sandboxes=2, memory_mb=128, pids=32, timeout_s=5),
        reward=RewardConfig(normalize="group", format_weight=0.5),
    )
    prompt, spec = reverse_domain.generate(random.Random(7))
    word = spec["word"]
    assert prompt == f"reverse {word}:"
    samples = [completion("rev", 0, f"{word[::-1]}\n", spec), completion("rev", 1, f"{word}!\n", spec)]

    async with Runtime(cfg) as rt, SandboxResources(cfg.sandbox) as resources:
        supervisor = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
        for actor_spec in build_sandbox_actors(rt, resources):
            supervisor.add_spec(actor_spec)
        reward = RewardActor(rt)
        outcomes = Consumer(cfg.kafka, assign=[(rt.names.outcomes, 0)], expect=(Outcome.SCHEMA,))
        experience = Consumer(cfg.kafka, assign=[(rt.names.experience, 0)], expect=(Experience.SCHEMA,))
        got_outcomes: list[Outcome] = []
        got: list[Experience] = []
        async with outcomes, experience, anyio.create_task_group() as tg:
            tg.start_soon(supervisor.run)
            tg.start_soon(reward.run)
            for sample in samples:
                await rt.producer.send(rt.names.completions, sample, key=sample.task_id)
            with anyio.fail_after(90):
                while len(got) < 2:
                    got += [r.message for r in await experience.getmany(timeout_s=0.2)]  # type: ignore[misc]
                while len(got_outcomes) < 2:
                    got_outcomes += [r.message for r in await outcomes.getmany(timeout_s=0.2)]  # type: ignore[misc]
            verified = supervisor.actors["sandbox.verify"].statistics()["verified"]
            reward.request_drain()
            supervisor.drain()

    by_outcome = {o.completion["sample_id"]: o for o in got_outcomes}
    assert {o.verifier for o in got_outcomes} == {NAME} and [o.error for o in got_outcomes] == ["", ""]
    assert by_outcome["rev/0"].facts == {"expected": word[::-1], "correct": True}
    assert by_outcome["rev/1"].facts["correct"] is False
    assert verified == {NAME: 2}
    by_sample = {e.sample_id: e for e in got}
    right, wrong = by_sample["rev/0"], by_sample["rev/1"]
    assert (right.domain, right.filtered, wrong.filtered) == (NAME, "", "")
    # correctness + 0.5 * format (the domain's own functions), minus the group mean
    assert (right.reward, wrong.reward) == (pytest.approx(1.5), pytest.approx(0.0))
    assert (right.advantage, wrong.advantage) == (pytest.approx(0.75), pytest.approx(-0.75))
