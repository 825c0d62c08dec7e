"""`rollout demo`'s plan for the real model: it trains several domains at once, each one real, with a
held-out split the before/after table scores, and deploy/examples/smollm2-multidomain.toml is its engine setup."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

from actors.evaluate import DomainScore
from domains import DOMAINS
from engine.config import load_config
from ops.demo import Heldout, RealPlan, print_tables, real_config, trained_domains

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_trains_at_least_three_real_domains_each_with_a_heldout_split() -> None:
    plan = RealPlan()
    assert len(plan.train) >= 3 and all(w > 0 for w in plan.train.values())
    for name in plan.heldout:
        domain = DOMAINS[name]  # exists (a KeyError names it otherwise)
        assert len(domain.heldout(plan.heldout[name])) >= min(plan.heldout[name], 8), name
    for name in plan.train:
        assert DOMAINS[name].trainable and name in plan.heldout, name  # scored before and after
    assert set(plan.heldout) - set(plan.train), "no untrained domain: transfer and regressions go unseen"


def test_the_demo_config_balances_adaptively_and_weighs_domains_by_samples(tmp_path: Path) -> None:
    cfg = real_config("ns", "127.0.0.1:9092", "nats://127.0.0.1:4222", tmp_path, RealPlan())
    assert cfg.scheduler.domains == RealPlan().train and trained_domains(cfg) == sorted(RealPlan().train)
    assert cfg.scheduler.balance_policy == "signal"
    assert cfg.scheduler.balance.floor * len(cfg.scheduler.domains) <= 1 <= cfg.scheduler.balance.cap * len(cfg.scheduler.domains)
    assert cfg.learner.loss_weighting == "domain_mean"
    single = real_config("ns", "127.0.0.1:9092", "nats://127.0.0.1:4222", tmp_path,
                         RealPlan(train={"math": 1.0}, balance=None, loss_weighting="token_mean"))
    assert single.scheduler.balance_policy == "static" and single.learner.loss_weighting == "token_mean"


def test_the_multidomain_example_is_the_demos_engine_setup(tmp_path: Path) -> None:
    example = load_config(REPO / "deploy" / "examples" / "smollm2-multidomain.toml", environ={})
    ours = real_config("smollm2-multidomain", example.kafka.bootstrap, example.nats.url, tmp_path, RealPlan())
    assert len(example.scheduler.domains) >= 3 and example.scheduler.balance_policy == "signal"
    for section in ("scheduler", "inference", "reward"):
        assert getattr(example, section).model_dump(exclude={"seed"}) == getattr(ours, section).model_dump(exclude={"seed"}), section
    skip = {"checkpoint_dir", "max_steps", "checkpoint_every", "seed"}
    assert example.learner.model_dump(exclude=skip) == ours.learner.model_dump(exclude=skip)


def test_the_table_marks_trained_and_untrained_domains() -> None:
    def scores(acc: float) -> Heldout:
        return Heldout({d: DomainScore(d, 4, acc, acc, 2) for d in ("math", "python")}, {})

    out = io.StringIO()
    with redirect_stdout(out):
        print_tables({"math": {1: 0.5}}, scores(0.25), scores(0.5), trained={"math"})
    rows = [ln.split() for ln in out.getvalue().splitlines() if ln.startswith(("math", "python"))]
    assert rows[0][:2] == ["math", "trained"] and rows[1][:2] == ["python", "untrained"]
    assert rows[0][-1] == "+0.250"
