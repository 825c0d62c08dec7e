"""Off-policy corrections (``learner.off_policy`` presets) and the staleness policies, on hand-built tensors
and the tiny model: what each preset masks, truncates and weighs, and that masked tokens get no gradient."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from learning.core import Learner, behaviour_weights, collate, policy_loss, response_logprobs
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config
from engine.config import LearnerConfig
from engine.schemas import Experience

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def model():
    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    return build_tiny_model(cfg, seed=0)


def make_exp(sid: str, *, versions: list[int] | None = None, logprobs: list[float] | None = None,
             response: list[int] | None = None, advantage: float = 1.0) -> Experience:
    response = response if response is not None else [10, 20, 30, 40]
    n = len(response)
    return Experience(
        sample_id=sid, task_id=f"task-{sid}", domain="arith", prompt_ids=np.asarray([5, 6, 7], dtype=np.int32),
        response_ids=np.asarray(response, dtype=np.int32),
        logprobs=np.asarray(logprobs if logprobs is not None else [-4.0] * n, dtype=np.float32),
        loss_mask=np.ones(n, dtype=np.uint8),
        weight_versions=np.asarray(versions if versions is not None else [0] * n, dtype=np.int32),
        reward=1.0, advantage=advantage, group_size=4)


def loss_and_grad(ratios: list[list[float]], preset: str, *, band: tuple[float, float] | None = None,
                  tis_cap: float = 2.0, objective: str = "tis") -> tuple[torch.Tensor, dict[str, float]]:
    """Gradient of the loss w.r.t. logp for rows of proximal/behaviour ratios (advantage 1, logp = prox)."""
    r = torch.tensor(ratios, dtype=torch.float32)
    behav = torch.full_like(r, -2.0)
    prox = behav + torch.log(r)
    logp = prox.clone().requires_grad_(True)
    mask = torch.ones_like(r, dtype=torch.bool)
    loss, stats = policy_loss(logp, prox, behav, torch.ones(r.shape[0], 1), mask, objective=objective,
                              tis_cap=tis_cap, clip_eps=0.2, off_policy=preset, band=band)
    (g,) = torch.autograd.grad(loss, logp)
    return g, stats


def test_token_tis_is_the_truncated_ratio_and_the_default():
    g, stats = loss_and_grad([[5.0, 0.5, 1.0]], "token_tis")
    assert torch.allclose(g, -torch.tensor([[2.0, 0.5, 1.0]]) / 3)
    assert stats["behav_truncated_frac"] == pytest.approx(1 / 3) and stats["behav_masked_frac"] == 0
    assert stats["behav_weight_mean"] == pytest.approx(3.5 / 3)
    assert LearnerConfig().off_policy == "token_tis"


def test_icepop_masks_tokens_outside_the_band_and_keeps_its_edges():
    ratios = [[0.5, 2.0, 0.49, 2.01, 1.25]]
    g, stats = loss_and_grad(ratios, "icepop", band=(0.5, 2.0))
    # inside [0.5, 2.0] (edges included) the weight is the untruncated ratio; outside, no gradient at all
    assert torch.allclose(g, -torch.tensor([[0.5, 2.0, 0.0, 0.0, 1.25]]) / 5)
    assert g[0, 2] == 0 and g[0, 3] == 0
    assert stats["behav_masked_frac"] == pytest.approx(2 / 5) and stats["behav_truncated_frac"] == 0
    assert stats["behav_weight_mean"] == pytest.approx(3.75 / 5)


def test_icepop_without_a_band_uses_the_preset_default():
    w, flags = behaviour_weights(torch.log(torch.tensor([[0.4, 1.0, 3.0]])), torch.ones(1, 3, dtype=torch.bool),
                                 preset="icepop")
    assert flags["masked"].tolist() == [[True, False, True]]  # default band (0.5, 2.0)
    assert w.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("objective", ["tis", "decoupled_ppo"])
def test_seq_mis_weighs_by_the_sequence_ratio_and_drops_a_whole_sequence_above_the_cap(objective):
    # row 0: product 1.2 * 1.5 = 1.8 <= cap 2: every token weighs 1.8; row 1: 1.2 * 2.5 = 3 > 2: all masked
    g, stats = loss_and_grad([[1.2, 1.5], [1.2, 2.5]], "seq_mis", objective=objective)
    assert torch.allclose(g[0], torch.full((2,), -1.8 / 4), atol=1e-6)
    assert torch.all(g[1] == 0)
    assert stats["behav_masked_frac"] == pytest.approx(0.5)
    assert stats["behav_weight_mean"] == pytest.approx(1.8 * 2 / 4, rel=1e-5)


def test_seq_mis_does_not_overflow_on_a_long_off_policy_sequence():
    lr = torch.full((1, 4096), 0.5)  # a product of e^2048: inf in fp32
    w, flags = behaviour_weights(lr, torch.ones_like(lr, dtype=torch.bool), preset="seq_mis", tis_cap=2.0)
    assert torch.all(w == 0) and bool(flags["masked"].all())


def test_geo_mask_drops_a_sequence_whose_geometric_mean_leaves_the_band():
    # row 0: token ratios 1.02 and 1/1.02, geometric mean 1 (kept, token TIS weights); row 1: every token
    # 1.02: geometric mean 1.02 > 1.01, the whole sequence masked though no single ratio is large
    g, stats = loss_and_grad([[1.02, 1 / 1.02], [1.02, 1.02]], "geo_mask", band=(0.99, 1.01))
    assert torch.allclose(g[0], -torch.tensor([1.02, 1 / 1.02]) / 4, atol=1e-6)
    assert torch.all(g[1] == 0)
    assert stats["behav_masked_frac"] == pytest.approx(0.5)


def test_geo_mask_edges_are_inside_the_band():
    lr = torch.tensor([[math.log(1.25)] * 3, [math.log(0.8)] * 3])
    w, flags = behaviour_weights(lr, torch.ones_like(lr, dtype=torch.bool), preset="geo_mask", band=(0.8, 1.25))
    assert not bool(flags["masked"].any())
    assert torch.allclose(w, torch.exp(lr))


def test_off_weighs_every_token_one():
    g, stats = loss_and_grad([[5.0, 0.1, 1.0]], "off")
    assert torch.allclose(g, -torch.ones(1, 3) / 3)
    assert stats["behav_weight_mean"] == pytest.approx(1.0) and stats["behav_masked_frac"] == 0


def test_tokens_off_the_loss_mask_count_neither_as_masked_nor_truncated():
    lr = torch.tensor([[0.0, 50.0, -50.0]])  # garbage on tokens 1 and 2, which are observations
    mask = torch.tensor([[True, False, False]])
    for preset in ("token_tis", "icepop", "seq_mis", "geo_mask", "off"):
        w, flags = behaviour_weights(lr, mask, preset=preset)
        assert w.tolist() == [[1.0, 0.0, 0.0]], preset
        assert not bool(flags["masked"].any()) and not bool(flags["truncated"].any()), preset


def test_bad_preset_and_band_are_named():
    lr, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="learner.off_policy 'tis2' is not one of"):
        behaviour_weights(lr, mask, preset="tis2")
    with pytest.raises(ValueError, match=r"learner.off_policy_band needs 0 <= low < high, got \[2.0, 1.0\]"):
        behaviour_weights(lr, mask, preset="icepop", band=(2.0, 1.0))
    with pytest.raises(ValueError, match=r"learner.off_policy_band needs 0 <= low < high, got \[1.5, 1.5\]"):
        behaviour_weights(lr, mask, preset="geo_mask", band=(1.5, 1.5))  # an empty band masks everything


@pytest.mark.parametrize("preset", ["icepop", "seq_mis", "geo_mask"])
def test_a_step_masks_the_off_policy_sample_only_and_reports_it(model, preset):
    """Two samples packed in one row (same prompt): one sampled by the learner's own policy (ratio 1), one
    whose behaviour logprobs are far off; the step masks the second one's tokens and no more."""
    near = make_exp("near", response=[10, 20, 30, 40])
    with torch.no_grad():
        own = response_logprobs(model, collate([near]))[0].tolist()
    near = make_exp("near", response=[10, 20, 30, 40], logprobs=own)
    far = make_exp("far", response=[11, 21, 31], logprobs=[-30.0, -30.0, -30.0])
    lrn = Learner(model, LearnerConfig(batch_size=2, off_policy=preset), max_staleness=1)
    lrn.offer(near)
    lrn.offer(far)
    metrics = lrn.step().metrics
    assert metrics["micro_batches"] == 1  # one row: the sequence grouping comes from the packed sample index
    assert metrics["behav_masked_frac"] == pytest.approx(3 / 7)
    assert metrics["behav_weight_mean"] == pytest.approx(4 / 7, rel=1e-3)  # ratio 1 on the near sample's tokens


# -- staleness policies ------------------------------------------------------------------------------

def test_downweight_trains_stale_samples_with_their_reason_and_age_factor(model):
    lrn = Learner(model, LearnerConfig(batch_size=3, staleness_policy="downweight", stale_decay=0.5),
                  max_staleness=1)
    lrn.version = 4
    assert lrn.offer(make_exp("fresh", versions=[4] * 4)) == "train"
    assert lrn.offer(make_exp("bound", versions=[3] * 4)) == "train"
    assert lrn.offer(make_exp("old", versions=[1, 2, 2, 2])) == "train"  # staleness 3: 2 beyond the bound
    assert lrn.stale_weights([make_exp("x", versions=[v] * 4) for v in (4, 3, 2, 1)]) == [1.0, 1.0, 0.5, 0.25]
    report = lrn.step()
    assert report.trained == ("fresh", "bound", "old") and report.dropped_stale == ()
    assert lrn.ledger.reasons == {"stale_downweighted": 1} and lrn.ledger.dropped_stale == 0
    assert report.metrics["stale_trained_frac"] == pytest.approx(1 / 3)
    assert report.metrics["stale_weight_mean"] == pytest.approx((1 + 1 + 0.25) / 3)


def test_drop_stays_the_default_and_reports_no_stale_training(model):
    lrn = Learner(model, LearnerConfig(batch_size=1), max_staleness=1)
    lrn.version = 4
    assert lrn.offer(make_exp("old", versions=[1] * 4)) == "dropped_stale"
    assert lrn.offer(make_exp("fresh", versions=[4] * 4)) == "train"
    metrics = lrn.step().metrics
    assert metrics["stale_trained_frac"] == 0 and metrics["stale_weight_mean"] == 1.0


def test_a_downweighted_sample_pulls_the_gradient_by_its_factor(model):
    norms = []
    for version in (3, 1):  # staleness 1 (within the bound) and 3 (two versions beyond it: factor 0.25)
        lrn = Learner(copy.deepcopy(model), LearnerConfig(batch_size=1, staleness_policy="downweight",
                                                          stale_decay=0.5, grad_clip=1e9), max_staleness=1)
        lrn.version = 4
        lrn.offer(make_exp("s", versions=[version] * 4))
        norms.append(lrn.step().metrics["grad_norm"])
    assert norms[1] == pytest.approx(0.25 * norms[0], rel=1e-4)
