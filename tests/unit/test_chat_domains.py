"""The instruct-model domains: tasks, strict answer rules, chat rendering, the demo's engine setup."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from domains import DOMAINS, score
from engine.config import load_config
from sandboxes.verifiers import extract_answer_by, verify_answer

if TYPE_CHECKING:
    from ops.demo import RealPlan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_math_at_difficulty_zero_is_the_plain_loops_task() -> None:
    rng = random.Random(0)
    for _ in range(200):
        prompt, spec = DOMAINS["math"].generate(rng, 0.0)
        m = re.fullmatch(r"What is (\d) ([-+*]) (\d)\? Answer with just the number\.", prompt)
        assert m is not None, prompt
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert 1 <= a <= 9 and 1 <= b <= 9
        assert int(spec["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
    prompt, _ = DOMAINS["math"].generate(rng, 0.95)
    assert len(re.findall(r"\d+", prompt)) == 3


@pytest.mark.anyio
async def test_the_first_number_is_the_answer() -> None:
    spec = {"answer": "56", "match": "first_number"}
    assert (await verify_answer("56", spec))["correct"]
    assert (await verify_answer("56 is the answer", spec))["correct"]
    assert not (await verify_answer("7 * 8 = 56", spec))["correct"]  # a restated question is not an answer
    assert not (await verify_answer("I think so", spec))["correct"]
    assert (await verify_answer("-3", {"answer": "-3", "match": "first_number"}))["correct"]
    facts = await verify_answer("7 * 8 = 56", spec)
    assert score("math", facts, "7 * 8 = 56").correctness == 0.0
    assert DOMAINS["math"].format_score("56") == 1.0 and DOMAINS["math"].format_score("The answer is 56") == 0.0


@pytest.mark.anyio
async def test_docqa_takes_the_first_candidate_named() -> None:
    rng = random.Random(3)
    prompt, spec = DOMAINS["docqa"].generate(rng, 0.0)
    assert spec["answer"] in spec["choices"] and "Passage: " in prompt
    other = next(c for c in spec["choices"] if c != spec["answer"])
    assert (await verify_answer(f'The answer is "{spec["answer"].title()}".', spec))["correct"]
    assert not (await verify_answer(f"{other}, or maybe {spec['answer']}", spec))["correct"]
    assert extract_answer_by("nothing here", "first_choice", ["red"]) is None
    with pytest.raises(ValueError, match="spec.match"):
        extract_answer_by("x", "middle")


def test_every_instruct_domain_has_a_budget_and_no_newline_stop() -> None:
    for name in ("math", "python", "shell", "docqa"):
        domain = DOMAINS[name]
        assert domain.stop == () and domain.max_new_tokens is not None
        prompt, spec = domain.generate(random.Random(1), 0.0)
        assert prompt and spec
        assert len(domain.heldout(8)) == 8


def test_python_and_shell_ideals_score_full_format() -> None:
    rng = random.Random(5)
    prompt, ideal = DOMAINS["python"].demonstrate(rng, 0.0)
    assert DOMAINS["python"].format_score(ideal) == 1.0
    assert DOMAINS["python"].format_score("Here you go:\n" + ideal) == 0.0
    _, ideal = DOMAINS["shell"].demonstrate(rng, 0.0)
    assert DOMAINS["shell"].format_score(ideal) == 1.0


def math_only_plan() -> "RealPlan":
    """The demo's plan as it was for one domain (the math example and the learning benchmark train math alone;
    the demo itself trains several: tests/unit/test_demo_plan.py)."""
    from ops.demo import RealPlan

    return RealPlan(train={"math": 1.0}, balance=None, loss_weighting="token_mean")


def test_the_example_config_is_the_demos_engine_setup(tmp_path: Path) -> None:
    from ops.demo import real_config

    example = load_config(REPO / "deploy" / "examples" / "smollm2-math.toml")
    ours = real_config("smollm2-math", example.kafka.bootstrap, example.nats.url, tmp_path, math_only_plan())
    for section in ("scheduler", "inference", "reward"):
        assert getattr(example, section) == getattr(ours, section), section
    skip = {"checkpoint_dir", "max_steps", "checkpoint_every"}
    assert example.learner.model_dump(exclude=skip) == ours.learner.model_dump(exclude=skip)


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log() -> None:
    from ops.demo import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = Progress(tty)
    bar.update(0.5, "half")
    bar.update(1.0, "done")
    bar.close()
    assert tty.getvalue().count("\r") == 2 and "[############............] half" in tty.getvalue()
    log = io.StringIO()
    lines = Progress(log, every_s=3600)
    lines.update(0.1, "first")
    lines.update(0.2, "second")  # within every_s: not printed until close
    lines.close()
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == ["[##......................] first", "[#####...................] second"]


def test_the_learning_benchmark_runs_the_demos_engine_setup(tmp_path: Path) -> None:
    import tomllib

    from loadtests import learning
    from ops.demo import real_config

    plan = learning.Plan(model_dir=str(tmp_path), seconds=60, save_root=tmp_path, work=tmp_path, minimal="x",
                         engine_batch=64, bootstrap="127.0.0.1:9092", nats_url="nats://127.0.0.1:4222")
    from engine.config import EngineConfig

    bench = EngineConfig.model_validate(tomllib.loads(learning.engine_config(plan, "ns", "math")))
    ours = real_config("ns", "127.0.0.1:9092", "nats://127.0.0.1:4222", tmp_path, math_only_plan())
    assert bench.scheduler.model_dump(exclude={"seed"}) == ours.scheduler.model_dump(exclude={"seed"})
    keep = {"max_new_tokens", "temperature", "concurrency", "max_batch", "stream_interval"}
    assert bench.inference.model_dump(include=keep) == ours.inference.model_dump(include=keep)
    assert (bench.reward.drop_zero_variance, bench.reward.normalize) == (ours.reward.drop_zero_variance,
                                                                        ours.reward.normalize)
    keep = {"batch_size", "lr", "objective", "publish_every", "torch_threads", "autocast", "publish_dtype",
            "share_prefix", "micro_batch_tokens"}
    assert bench.learner.model_dump(include=keep) == ours.learner.model_dump(include=keep)
