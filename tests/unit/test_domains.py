"""Built-in domains: deterministic generators, disjoint held-out splits, demonstrations, rewards."""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest

from domains import DOMAINS, Domain, GeneratedTask, answer_format, code_format, is_heldout, register_domain, \
    reward_fn, score, terminal_format, unregister_domain
from engine.config import RewardConfig
from engine.schemas import Completion
from sandboxes.verifiers import VERIFIERS, verify_answer

DIFFICULTIES = (0.0, 0.5, 1.0)
GENERATED = sorted(n for n in DOMAINS if DOMAINS[n].source == "generator")
"""Domains with a task generator (benchmarks read files or a package's fixed problems: tests/unit/test_benchmarks.py)."""


@pytest.mark.parametrize("name", GENERATED)
@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_generators_are_deterministic(name: str, difficulty: float) -> None:
    domain = DOMAINS[name]
    a = [domain.generate(random.Random(7), difficulty) for _ in range(3)]
    b = [domain.generate(random.Random(7), difficulty) for _ in range(3)]
    assert a == b
    rng = random.Random(7)
    draws = [domain.generate(rng, difficulty)[0] for _ in range(30)]
    assert len(set(draws)) > 3  # a stream, not one task repeated


@pytest.mark.parametrize("name", GENERATED)
def test_heldout_split_is_disjoint_from_training(name: str) -> None:
    domain = DOMAINS[name]
    heldout = {p for d in DIFFICULTIES for p, _ in domain.heldout(50, seed=3, difficulty=d)}
    assert heldout and all(is_heldout(p) for p in heldout)
    rng = random.Random(0)
    train = {domain.generate(rng, d)[0] for d in DIFFICULTIES for _ in range(300)}
    assert not heldout & train
    assert domain.heldout(10, seed=3) == domain.heldout(10, seed=3)


@pytest.mark.parametrize("name", GENERATED)
def test_heldout_prompts_are_distinct_and_capped_by_the_space(name: str) -> None:
    domain = DOMAINS[name]
    small = domain.heldout(5, seed=1)
    assert len(small) == 5 and len({p for p, _ in small}) == 5
    everything = domain.heldout(10_000, seed=1)  # more than the easiest level's held-out space holds (docqa's is larger)
    prompts = [p for p, _ in everything]
    assert len(prompts) == len(set(prompts)) <= 10_000
    if name not in ("docqa", "longdoc"):  # open-ended prompt spaces
        assert len(prompts) < 10_000
    assert set(p for p, _ in small) <= set(prompts)


@pytest.mark.parametrize("name", GENERATED)
def test_demonstration_matches_the_generated_task(name: str) -> None:
    domain = DOMAINS[name]
    for seed in range(5):
        prompt, _ = domain.generate(random.Random(seed), 0.5)
        demo_prompt, ideal = domain.demonstrate(random.Random(seed), 0.5)
        assert demo_prompt == prompt
        # a newline-stopped domain's turns end with the stop; an instruct domain's end at the end-of-turn token
        assert ideal.endswith("\n") == ("\n" in domain.stop) and domain.format_score(ideal) == 1.0
        if "\n" in domain.stop:
            assert len(prompt) + len(ideal) < 200  # tiny, for a char-level model


def test_arith_difficulty_grows_operands_and_answers_verify() -> None:
    arith = DOMAINS["arith"]
    easy = [arith.generate(random.Random(s), 0.0)[0] for s in range(50)]
    hard = [arith.generate(random.Random(s), 1.0)[0] for s in range(50)]
    assert max(map(len, easy)) <= len("9+9=")
    assert all(p.count("+") + p.count("-") + p.count("*") == 2 for p in hard)

    async def check() -> None:
        for seed in range(20):
            prompt, ideal = arith.demonstrate(random.Random(seed), 1.0)
            _, spec = arith.generate(random.Random(seed), 1.0)
            assert int(spec["answer"]) >= 0
            facts = await verify_answer(ideal, spec)
            assert facts["correct"] and reward_fn("arith", facts, ideal) == 1.0
            assert not (await verify_answer("Answer: 100000", spec))["correct"]

    anyio.run(check)


def test_code_tests_check_the_reference_program() -> None:
    for seed in range(20):
        _, spec = DOMAINS["code"].generate(random.Random(seed), 1.0)
        _, ideal = DOMAINS["code"].demonstrate(random.Random(seed), 1.0)
        namespace: dict = {}
        exec(ideal, namespace)  # noqa: S102 - our own reference program
        for test in spec["tests"]:
            exec(test["code"].replace("from solution import f\n", ""), dict(namespace))  # noqa: S102


def test_terminal_spec_shape() -> None:
    for seed in range(20):
        _, spec = DOMAINS["terminal"].generate(random.Random(seed), 1.0)
        _, ideal = DOMAINS["terminal"].demonstrate(random.Random(seed), 1.0)
        assert set(spec) == {"setup_files", "checks", "max_turns"}
        assert len(ideal.splitlines()) < spec["max_turns"] <= 4
        assert all(isinstance(c["cmd"], str) for c in spec["checks"])


def test_reward_functions_from_facts() -> None:
    assert reward_fn("arith", {"correct": True}, "19") == 1.0
    assert reward_fn("arith", {"correct": False}, "18") == 0.0
    assert reward_fn("code", {"passed": 2, "total": 3}, "") == pytest.approx(2 / 3)
    assert reward_fn("code", {"passed": 0, "total": 0}, "") == 0.0
    assert reward_fn("terminal", {"checks_passed": 1, "checks_total": 2}, "") == 0.5
    assert reward_fn("terminal", {}, "") == 0.0
    # an unregistered domain falls back to its verifier's reward
    assert reward_fn("gsm8k", {"correct": True}, "x", verifier="answer") == 1.0
    with pytest.raises(KeyError):
        reward_fn("nope", {}, "")


def test_format_and_length_terms() -> None:
    cfg = RewardConfig(format_weight=0.5, length_penalty=0.01)
    r = score("arith", {"correct": True}, "19\n", cfg)
    assert (r.correctness, r.format, r.tokens) == (1.0, 1.0, 3)
    assert r.total == pytest.approx(1.0 + 0.5 - 0.03)
    assert score("arith", {"correct": False}, "the answer", cfg).format == 0.0
    completion = Completion(
        sample_id="s", task_id="t", domain="arith", group_index=0, group_size=1,
        prompt_ids=np.zeros(3, np.int32), response_ids=np.zeros(5, np.int32), logprobs=np.zeros(5, np.float32),
        loss_mask=np.array([1, 1, 0, 0, 1], np.uint8), weight_versions=np.zeros(5, np.int32), text="19",
        finish_reason="stop")
    assert score("arith", {"correct": True}, completion, cfg).tokens == 3  # model tokens only
    assert answer_format("Answer: 19") == 0.0
    assert code_format("def f(x): return x+1") == 1.0 and code_format("def g(x): return 1") == 0.0
    assert code_format("def f(x) return") == 0.0
    assert terminal_format("echo hi > a.txt\nfoo bar") == 0.5 and terminal_format("") == 0.0


def test_register_domain() -> None:
    def make(rng: random.Random, difficulty: float) -> GeneratedTask:
        word = rng.choice(["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx"])
        return GeneratedTask(prompt=f"echo {word}:", spec={"answer": word}, ideal=f"{word}\n")

    domain = Domain("echo_test", "answer", make, lambda facts, text: 1.0 if facts.get("correct") else 0.0,
                    lambda text: 1.0)
    try:
        register_domain(domain)
        assert DOMAINS["echo_test"] is domain
        assert reward_fn("echo_test", {"correct": True}, "ab") == 1.0
        assert (domain.verifier_name, domain.verify) == ("answer", VERIFIERS["answer"])
        with pytest.raises(ValueError):
            register_domain(domain)
        register_domain(domain, replace=True)
    finally:
        assert unregister_domain("echo_test") is domain
    with pytest.raises(KeyError, match="echo_test"):
        reward_fn("echo_test", {"correct": True}, "ab")
    assert reward_fn("echo_test", {"correct": True}, "ab", verifier="answer") == 1.0  # the verifier's reward


def test_register_domain_checks_the_verifier() -> None:
    def make(rng: random.Random, difficulty: float) -> GeneratedTask:
        return GeneratedTask(prompt="x", spec={}, ideal="x\n")

    with pytest.raises(ValueError, match="'no-such'"):
        register_domain(Domain("bad_verifier", "no-such", make, lambda f, t: 0.0, lambda t: 0.0))
    with pytest.raises(TypeError, match="verifier"):
        register_domain(Domain("bad_verifier", 42, make, lambda f, t: 0.0, lambda t: 0.0))  # type: ignore[arg-type]
    assert "bad_verifier" not in DOMAINS
