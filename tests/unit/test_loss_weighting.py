"""Balanced gradients: learner.loss_weighting (token_mean | sequence_mean | domain_mean) and the learner's
per-domain report (learning/core.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from learning.core import (Learner, domain_report, pack, policy_loss, sample_loss_weights, token_weights,
                                 trained_tokens)
from actors.learner_sim import SimulatedLearner
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config
from engine.config import LearnerConfig, LearnerSimulateConfig
from engine.schemas import Experience

pytestmark = pytest.mark.timeout(120)


def exp(sid: str, domain: str, length: int, *, advantage: float = 1.0, reward: float = 1.0,
        prompt: tuple[int, ...] = (5, 6, 7)) -> Experience:
    return Experience(sample_id=sid, task_id=f"task-{sid}", domain=domain, prompt_ids=np.asarray(prompt, dtype=np.int32),
                      response_ids=np.asarray([10 + (i % 20) for i in range(length)], dtype=np.int32),
                      logprobs=np.full(length, -3.0, dtype=np.float32), loss_mask=np.ones(length, dtype=np.uint8),
                      weight_versions=np.zeros(length, dtype=np.int32), reward=reward, advantage=advantage,
                      group_size=2)


def domain_weight(domains: list[str], tokens: list[float], weighting: str) -> dict[str, float]:
    w = sample_loss_weights(domains, tokens, weighting)
    out: dict[str, float] = {}
    for d, n, wi in zip(domains, tokens, w):
        out[d] = out.get(d, 0.0) + wi * n
    return out


def test_domain_mean_follows_sampling_share_not_token_count() -> None:
    # two domains, equal samples, answers of 10 and 40 tokens (1:4)
    domains, tokens = ["short", "short", "long", "long"], [10.0, 10.0, 40.0, 40.0]
    assert domain_weight(domains, tokens, "token_mean") == pytest.approx({"short": 0.2, "long": 0.8})  # 4x
    assert domain_weight(domains, tokens, "domain_mean") == pytest.approx({"short": 0.5, "long": 0.5})
    assert domain_weight(domains, tokens, "sequence_mean") == pytest.approx({"short": 0.5, "long": 0.5})
    # 1 long sample to 3 short ones: domain_mean gives 1/4 to the long domain whatever its lengths
    domains, tokens = ["long", "short", "short", "short"], [200.0, 5.0, 10.0, 15.0]
    assert domain_weight(domains, tokens, "domain_mean") == pytest.approx({"long": 0.25, "short": 0.75})
    assert domain_weight(domains, tokens, "token_mean")["long"] == pytest.approx(200 / 230)
    # within a domain, domain_mean is a token mean; sequence_mean is not
    w = sample_loss_weights(["a", "a"], [10.0, 30.0], "domain_mean")
    assert w[0] == w[1] == pytest.approx(1 / 40)
    w = sample_loss_weights(["a", "a"], [10.0, 30.0], "sequence_mean")
    assert (w[0] * 10, w[1] * 30) == pytest.approx((0.5, 0.5))
    # a sample without trained tokens weighs nothing; weights sum to 1 over tokens
    w = sample_loss_weights(["a", "b", "b"], [0.0, 4.0, 6.0], "domain_mean")
    assert w[0] == 0 and w[1] * 4 + w[2] * 6 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="learner.loss_weighting 'loudest'"):
        sample_loss_weights(["a"], [1.0], "loudest")


@pytest.mark.parametrize("weighting,short_share", [("token_mean", 0.2), ("domain_mean", 0.5)])
def test_the_gradient_of_each_domain_follows_the_weighting(weighting: str, short_share: float) -> None:
    """The policy loss's gradient w.r.t. each token's logprob is -A x weight: a domain's total gradient mass
    is its weight share (all |A| = 1 here)."""
    samples = [exp("s1", "short", 10), exp("s2", "short", 10, advantage=-1.0),
               exp("l1", "long", 40), exp("l2", "long", 40, advantage=-1.0)]
    mbs = pack(samples, micro_batch_tokens=4096)
    assert len(mbs) == 1
    mb = mbs[0]
    weights = torch.tensor(sample_loss_weights([s.domain for s in samples], trained_tokens(samples, mbs), weighting))
    logp = mb.behav_logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, logp.detach(), mb.behav_logp, mb.advantages, mb.loss_mask, objective="tis",
                          tis_cap=2.0, clip_eps=0.2, weights=token_weights(mb, weights))
    (g,) = torch.autograd.grad(loss, logp)
    short = torch.tensor([samples[i].domain == "short" for i in mb.sample_index.tolist()])
    mass_short, mass_long = float(g[short].abs().sum()), float(g[~short].abs().sum())
    assert mass_short / (mass_short + mass_long) == pytest.approx(short_share)
    # token_mean through explicit weights is exactly the unweighted token mean
    if weighting == "token_mean":
        plain, _ = policy_loss(logp, logp.detach(), mb.behav_logp, mb.advantages, mb.loss_mask, objective="tis",
                               tis_cap=2.0, clip_eps=0.2)
        assert float(loss.detach()) == pytest.approx(float(plain.detach()), rel=1e-6, abs=1e-7)
    report = domain_report(samples, trained_tokens(samples, mbs), weights.tolist())
    assert report["short"]["grad_share"] == pytest.approx(short_share)
    assert report["short"]["loss_weight"] == pytest.approx(short_share)


def test_the_learner_reports_per_domain_figures() -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                         num_kv_heads=1), seed=0)
    cfg = LearnerConfig(batch_size=4, loss_weighting="domain_mean", domain_grad_norms=True, lr=1e-3)
    learner = Learner(model, cfg, max_staleness=4)
    samples = [exp("s1", "short", 3, advantage=1.0, reward=1.0), exp("s2", "short", 3, advantage=-1.0, reward=0.0),
               exp("l1", "long", 12, advantage=0.5, reward=0.75, prompt=(8, 9)),
               exp("l2", "long", 12, advantage=-0.5, reward=0.25, prompt=(8, 9))]
    for s in samples:
        assert learner.offer(s) == "train"
    report = learner.step()
    short, long_ = report.domains["short"], report.domains["long"]
    assert (short["samples"], short["tokens"], long_["samples"], long_["tokens"]) == (2, 6, 2, 24)
    assert (short["reward"], long_["reward"]) == pytest.approx((0.5, 0.5))
    assert (short["adv_abs"], long_["adv_abs"]) == pytest.approx((1.0, 0.5))
    assert (short["loss_weight"], long_["loss_weight"]) == pytest.approx((0.5, 0.5))
    assert short["grad_norm"] > 0 and long_["grad_norm"] > 0  # exact, from one extra backward per domain
    assert short["grad_share"] + long_["grad_share"] == pytest.approx(1.0)
    assert np.isfinite(report.metrics["loss"]) and learner.last_domains is report.domains


def test_a_simulated_step_reports_per_domain_figures_too() -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                         num_kv_heads=1), seed=0)
    cfg = LearnerConfig(batch_size=2, simulate=LearnerSimulateConfig(time_scale=0.0))
    learner = SimulatedLearner(model, cfg, max_staleness=4, sleep=lambda s: None)
    for s in (exp("a", "x", 4), dataclasses.replace(exp("b", "y", 12), advantage=-1.0)):
        learner.offer(s)
    report = learner.step()
    assert report.domains["y"]["tokens"] == 12 and report.domains["x"]["loss_weight"] == pytest.approx(0.25)
