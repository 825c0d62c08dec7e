"""Pure logic of actors/sandbox/: spec clamping, verifier choice, failure facts, per-key locks."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from domains import DOMAINS, Domain, register_domain, score, unregister_domain
from actors.runtime import Runtime
from actors.sandbox import (SandboxResources, SandboxSettings, VerifyActor, _KeyedLocks, clamp_spec, failed_facts,
                            pick_verifier)
from engine.config import EngineConfig, SandboxConfig
from engine.schemas import SANDBOX_ERROR, Completion
from sandboxes.verifiers import VERIFIERS
from streams.memory import MemoryEventLog

CFG = SandboxConfig(timeout_s=10, memory_mb=256, pids=64)


def test_absurd_limits_are_clamped_and_reported() -> None:
    spec = {"timeout_s": 1e9, "memory_mb": 1 << 40, "pids": -5, "max_turns": "many",
            "checks": [{"cmd": "true", "timeout_s": float("inf")}, {"cmd": "true"}], "answer": "42"}
    out, clamped = clamp_spec(spec, CFG, SandboxSettings())
    assert out["timeout_s"] == 10 and out["memory_mb"] == 256 and out["pids"] == 64 and out["max_turns"] == 64
    assert [c["timeout_s"] for c in out["checks"]] == [10, 10]
    assert sorted(clamped) == ["checks[0].timeout_s", "max_turns", "memory_mb", "pids", "timeout_s"]
    assert out["answer"] == "42" and spec["timeout_s"] == 1e9  # the input is not modified


def test_reasonable_limits_pass_unchanged() -> None:
    spec = {"timeout_s": 2, "tests": [{"code": "pass"}] * 3}
    assert clamp_spec(spec, CFG, SandboxSettings()) == (spec, [])


def test_too_many_tests_are_cut() -> None:
    out, clamped = clamp_spec({"tests": [{"code": "pass"}] * 100}, CFG, SandboxSettings(max_tests=5))
    assert len(out["tests"]) == 5 and clamped == ["tests"]


def test_verifier_by_domain_and_override() -> None:
    assert pick_verifier("arith", {}) == ("answer", VERIFIERS["answer"])
    assert pick_verifier("code", {}) == ("code", VERIFIERS["code"])
    assert pick_verifier("terminal", {}) == ("terminal", VERIFIERS["terminal"])
    assert pick_verifier("code", {"verifier": "answer"}) == ("answer", VERIFIERS["answer"])
    with pytest.raises(ValueError, match="domain 'poetry'"):
        pick_verifier("poetry", {})
    with pytest.raises(ValueError, match="spec.verifier"):
        pick_verifier("arith", {"verifier": "rm -rf /"})
    with pytest.raises(ValueError, match="spec.verifier"):
        pick_verifier("arith", {"verifier": ["answer"]})


def test_a_registered_domain_brings_its_verifier() -> None:
    async def rhymes(text: str, spec: dict, pool: object) -> dict:
        return {"correct": text.endswith(spec["rhyme"])}

    by_name = Domain("poetry-by-name", "answer", lambda rng, d: None, lambda f, t: 0.0, lambda t: 0.0)
    own = Domain("poetry-own", rhymes, lambda rng, d: None, lambda f, t: 0.0, lambda t: 0.0)
    try:
        register_domain(by_name)
        register_domain(own)
        assert pick_verifier("poetry-by-name", {}) == ("answer", VERIFIERS["answer"])
        assert pick_verifier("poetry-own", {}) == ("poetry-own", rhymes)
        assert pick_verifier("poetry-own", {"verifier": "code"}) == ("code", VERIFIERS["code"])
    finally:
        unregister_domain("poetry-by-name")
        unregister_domain("poetry-own")
    with pytest.raises(ValueError, match="domain 'poetry-own'"):
        pick_verifier("poetry-own", {})


def test_failed_facts_score_nothing() -> None:
    assert failed_facts("answer", {}, "boom") == {"error": "boom", "extracted": None, "correct": False}
    code = failed_facts("code", {"tests": [1, 2]}, "boom")
    assert (code["passed"], code["total"], code["error"]) == (0, 2, "boom")
    assert failed_facts("code", {"tests": "x"}, "e")["total"] == 0
    assert failed_facts("terminal", {"checks": [1]}, "e")["checks_passed"] == 0


def test_keyed_locks_serialize_one_key_in_arrival_order_and_clean_up() -> None:
    locks = _KeyedLocks()
    order: list[str] = []

    async def use(key: str, tag: str, delay: float) -> None:
        async with locks.hold(key):
            order.append(f"{tag}+")
            await asyncio.sleep(delay)
            order.append(f"{tag}-")

    async def main() -> None:
        await asyncio.gather(use("a", "a1", 0.02), use("a", "a2", 0), use("b", "b1", 0.01))

    asyncio.run(main())
    assert order.index("a1-") < order.index("a2+")
    assert order.index("b1+") < order.index("a1-")  # other keys are not blocked
    assert locks._locks == {}


# -- VerifyActor: a multi-turn (repo) completion is judged from its own episode ------------------------------

def _repo_completion(**kw: Any) -> Completion:
    n = 4
    fields: dict[str, Any] = dict(sample_id="s/0", task_id="s", domain="repo", group_index=0, group_size=1,
                        prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
                        logprobs=np.zeros(n, np.float32), loss_mask=np.array([1, 1, 0, 0], np.uint8),
                        weight_versions=np.array([0, 0, -1, -1], np.int32), text='<tool_call>{"name": "run_tests"}',
                        finish_reason="stop", spec={"template": "add_k", "k": 3, "seed": 1, "max_turns": 6},
                        turns=2)
    fields.update(kw)
    return Completion(**fields)


def _verify_actor() -> tuple[VerifyActor, SandboxResources]:
    """A VerifyActor over in-memory transports and sandbox resources that were never acquired: any use of a
    sandbox (``resources.pool``) would raise, so a replay in a fresh sandbox cannot go unnoticed."""
    cfg = EngineConfig()
    resources = SandboxResources(cfg.sandbox)
    return VerifyActor(Runtime(cfg, event_log=MemoryEventLog(), use_nats=False), resources), resources


def test_a_repo_completion_is_verified_from_its_episode_facts_without_a_sandbox() -> None:
    actor, resources = _verify_actor()
    facts = {"hidden_passed": 4, "hidden_total": 6, "turns": 2, "tool_calls": 2, "tool_errors": 0, "completed": False}
    kind, got, error = asyncio.run(actor.verify(_repo_completion(episode_facts=facts)))
    assert (kind, got, error) == ("repo", facts, "")
    assert resources._pool is None and resources._refs == 0  # no sandbox acquired
    assert actor.verifier_errors == 0 and actor.episodes_lost == 0
    assert score("repo", got, "").correctness == DOMAINS["repo"].reward(facts, "") == 4 / 6
    # the contrast: without episode facts the repo verifier replays the text in a sandbox; none here, so it fails
    kind, got, error = asyncio.run(actor.verify(_repo_completion()))
    assert kind == "repo" and "not acquired" in error and actor.verifier_errors == 1


def test_a_repo_episode_that_lost_its_sandbox_is_an_error_not_a_zero_reward() -> None:
    actor, resources = _verify_actor()
    lost = _repo_completion(finish_reason=SANDBOX_ERROR, episode_facts={"error": "no sandbox reply for s/0 step 2"})
    kind, facts, error = asyncio.run(actor.verify(lost))
    assert kind == "repo" and error == "episode lost its sandbox: no sandbox reply for s/0 step 2"
    assert "hidden_passed" not in facts and resources._pool is None
    assert actor.episodes_lost == 1 and actor.verifier_errors == 0
    # no reason given still makes it an error
    kind, facts, error = asyncio.run(actor.verify(_repo_completion(finish_reason=SANDBOX_ERROR)))
    assert error == "episode lost its sandbox: no reason given"
