"""The learner's core without infrastructure: loss math, staleness, de-duplication, ledger, checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actors.learner_checkpoint import CheckpointStore
from learning import lora
from learning.core import (
    Learner,
    SeenIds,
    collate,
    pack,
    packed_logprobs,
    policy_loss,
    response_logprobs,
    sft_warm_start,
    unpack,
)
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config
from engine.config import LearnerConfig
from engine.schemas import Experience

pytestmark = pytest.mark.timeout(60)


def mean_logprob(model, samples: list[Experience], pad_id: int = 0) -> float:  # type: ignore[no-untyped-def]
    """Mean loss-masked response logprob of ``samples`` under ``model`` (how these tests see what a step did)."""
    batch = collate(samples, pad_id)
    with torch.no_grad():
        logp = response_logprobs(model, batch)
    m = batch.loss_mask.to(logp.dtype)
    value = float((logp * m).sum() / m.sum().clamp_min(1.0))
    return value if math.isfinite(value) else float("-inf")


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def model(tokenizer):
    cfg = tiny_config(len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    return build_tiny_model(cfg, seed=0)


def make_exp(sid: str, *, versions: list[int] | None = None, mask: list[int] | None = None, advantage: float = 1.0,
             filtered: str = "", response: list[int] | None = None, prompt: list[int] | None = None,
             logprob: float = -4.0, facts: dict | None = None, temperature: float = 1.0) -> Experience:
    response = response if response is not None else [10, 20, 30, 40]
    n = len(response)
    return Experience(
        sample_id=sid, task_id=f"task-{sid}", domain="arith",
        prompt_ids=np.asarray(prompt if prompt is not None else [5, 6, 7], dtype=np.int32),
        response_ids=np.asarray(response, dtype=np.int32),
        logprobs=np.full(n, logprob, dtype=np.float32),
        loss_mask=np.asarray(mask if mask is not None else [1] * n, dtype=np.uint8),
        weight_versions=np.asarray(versions if versions is not None else [0] * n, dtype=np.int32),
        reward=1.0, advantage=advantage, group_size=4, filtered=filtered, facts=facts or {}, temperature=temperature)


def grads(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# -- loss math ---------------------------------------------------------------------------------------

def test_tis_weight_is_the_proximal_behaviour_ratio_truncated_at_the_cap():
    behav = torch.tensor([[-2.0, -2.0, -2.0]])
    prox = behav + torch.log(torch.tensor([[5.0, 0.5, 1.0]]))  # ratios 5 (over the cap of 2), 0.5, 1
    logp = prox.clone().requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(logp, prox, behav, torch.tensor([[1.0]]), mask, objective="tis", tis_cap=2.0, clip_eps=0.2)
    g = grads(loss, logp)
    # d/dlogp of -w * A * logp, averaged over 3 tokens
    assert torch.allclose(g, torch.tensor([[-2.0, -0.5, -1.0]]) / 3)
    assert stats["behav_truncated_frac"] == pytest.approx(1 / 3)
    assert float(loss.detach()) == pytest.approx(-(2.0 * prox[0, 0] + 0.5 * prox[0, 1] + prox[0, 2]).item() / 3, rel=1e-5)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_decoupled_ppo_clips_the_ratio_to_the_proximal_policy(adv):
    prox = torch.zeros(1, 3)
    ratios = torch.tensor([[1.5, 0.5, 1.1]])  # above, below and inside [0.8, 1.2]
    logp = torch.log(ratios).requires_grad_(True)
    behav = prox - math.log(3.0)  # pi_prox / pi_behav = 3, truncated to the cap of 2
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(logp, prox, behav, torch.tensor([[adv]]), mask, objective="decoupled_ppo",
                              tis_cap=2.0, clip_eps=0.2)
    g = grads(loss, logp)
    # gradient of 2 * max(-A r, -A clip(r)) w.r.t. log r is -2 A r where unclipped, 0 where clipped
    if adv > 0:
        expected = torch.tensor([[0.0, -2 * 0.5, -2 * 1.1]]) / 3  # r=1.5 clipped (no more push up)
    else:
        expected = torch.tensor([[2 * 1.5, 0.0, 2 * 1.1]]) / 3  # r=0.5 clipped (no more push down)
    assert torch.allclose(g, expected, atol=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["behav_weight_mean"] == pytest.approx(2.0)


@pytest.mark.parametrize("objective", ["tis", "decoupled_ppo"])
def test_loss_is_a_mean_over_loss_masked_tokens_only(objective):
    # token 1 is an observation token with garbage logprobs that would overflow exp()
    behav = torch.tensor([[-1.0, 0.0, -1.0, 0.0]])
    prox = torch.tensor([[-1.0, -500.0, -1.0, 0.0]])
    logp = prox.clone().requires_grad_(True)
    mask = torch.tensor([[True, False, True, False]])
    loss, stats = policy_loss(logp, prox, behav, torch.tensor([[2.0]]), mask, objective=objective, tis_cap=2.0,
                              clip_eps=0.2)
    g = grads(loss, logp)
    assert torch.isfinite(loss)
    assert g[0, 1] == 0 and g[0, 3] == 0
    assert torch.allclose(g[0, [0, 2]], torch.tensor([-1.0, -1.0]))  # -A * w * r / 2 tokens, w = r = 1
    assert stats["tokens"] == 2


def test_collate_pads_variable_lengths_without_changing_logprobs(model):
    a = make_exp("a", prompt=[5, 6], response=[10, 11, 12, 13, 14])
    b = make_exp("b", prompt=[7, 8, 9, 4], response=[20, 21], mask=[1, 0])
    c = make_exp("c", prompt=[5], response=[30, 31, 32], temperature=0.5)
    batched = response_logprobs(model, collate([a, b, c]))
    for i, s in enumerate([a, b, c]):
        alone = response_logprobs(model, collate([s]))[0]
        assert torch.allclose(batched[i, : len(s.response_ids)], alone, atol=1e-5)
    batch = collate([a, b, c])
    assert batch.loss_mask.tolist()[1] == [True, False, False, False, False]
    assert batch.temperature.flatten().tolist() == [1.0, 1.0, 0.5]


def grpo_batch(groups: int = 3, size: int = 4, *, seed: int = 0) -> list[Experience]:
    """Groups of samples sharing a prompt, responses of different lengths, one group at temperature 0.7."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(4, 90, size=int(rng.integers(3, 9))).tolist()
        temperature = 0.7 if g == 1 else 1.0
        for k in range(size):
            response = rng.integers(4, 90, size=int(rng.integers(1, 7))).tolist()
            mask = [1] * len(response)
            if len(response) > 2:
                mask[1] = 0  # an observation token inside the response
            out.append(make_exp(f"g{g}-{k}", prompt=prompt, response=response, mask=mask,
                                advantage=float(rng.normal()), logprob=-3.0, temperature=temperature))
    return out


def test_chunked_logprobs_match_a_full_vocabulary_log_softmax(model):
    samples = grpo_batch()
    batch = collate(samples)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        pred = (batch.target_pos - 1).clamp_min(0)
        full = torch.log_softmax(logits.gather(1, pred.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
                                 / batch.temperature, dim=-1)
        want = full.gather(-1, batch.input_ids.gather(1, batch.target_pos).unsqueeze(-1)).squeeze(-1)
        got = response_logprobs(model, batch, chunk=5)
    m = batch.loss_mask
    assert torch.allclose(got[m], want[m], atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_packing_gives_the_unpacked_logprobs_and_gradients(tokenizer, attn):
    cfg = tiny_config(len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, attn_implementation=attn)
    model = build_tiny_model(cfg, seed=1)
    samples = grpo_batch()
    batch = collate(samples)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0))
    unpacked = response_logprobs(model, batch)
    g_unpacked_all = torch.autograd.grad((unpacked * weights * batch.loss_mask).sum(), list(model.parameters()))
    mbs = pack(samples, micro_batch_tokens=10_000)
    assert len(mbs) == 1 and mbs[0].input_ids.shape[0] == 3  # one row per group: each prompt computed once
    logp, entropy = packed_logprobs(model, mbs[0], chunk=7)
    packed = unpack(samples, mbs, [logp])
    m = batch.loss_mask
    assert torch.allclose(packed[m], unpacked[m], atol=1e-4)
    g_packed_all = torch.autograd.grad((packed * weights * m).sum(), list(model.parameters()))
    for a, b in zip(g_unpacked_all, g_packed_all):
        assert torch.allclose(a, b, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in g_packed_all)
    # entropy of the policy at those positions, against a full softmax
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        pred = (batch.target_pos - 1).clamp_min(0)
        picked = logits.gather(1, pred.unsqueeze(-1).expand(-1, -1, logits.shape[-1])) / batch.temperature
        want = torch.distributions.Categorical(logits=picked).entropy()
    assert torch.allclose(unpack(samples, mbs, [entropy])[m], want[m], atol=1e-4)


def test_micro_batches_stay_under_the_token_budget_and_split_long_groups():
    samples = grpo_batch(groups=4, size=8, seed=3)
    for s in samples:  # as decoded from the wire: read-only arrays (torch warns on those, warnings are errors)
        for arr in (s.prompt_ids, s.response_ids, s.logprobs, s.loss_mask):
            arr.setflags(write=False)
    budget = 40
    mbs = pack(samples, micro_batch_tokens=budget)
    assert sum(len(mb.targets) for mb in mbs) == sum(len(s.response_ids) for s in samples)
    assert all(mb.padded_tokens <= budget for mb in mbs)
    seen = torch.cat([mb.sample_index * 100 + mb.token_index for mb in mbs])
    assert len(set(seen.tolist())) == len(seen)  # every token exactly once
    unshared = pack(samples, micro_batch_tokens=budget, share_prefix=False)
    assert sum(mb.input_ids.shape[0] for mb in unshared) == len(samples)


@pytest.mark.parametrize("objective", ["tis", "decoupled_ppo"])
def test_accumulated_micro_batches_step_like_one_big_batch(tokenizer, objective):
    cfg = tiny_config(len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    samples = grpo_batch(groups=3, size=4, seed=5)
    results = []
    for budget, share in ((100_000, False), (24, True), (24, False)):
        m = build_tiny_model(cfg, seed=2)
        lrn = Learner(m, LearnerConfig(batch_size=len(samples), lr=1e-2, objective=objective, grad_clip=100.0,
                                       micro_batch_tokens=budget, share_prefix=share), max_staleness=1)
        step = lrn.optimizer.step
        grads_at_step: dict[str, torch.Tensor] = {}

        def recording_step(step=step, grads_at_step=grads_at_step, m=m):
            grads_at_step.update({n: p.grad.clone() for n, p in m.named_parameters()})
            return step()

        lrn.optimizer.step = recording_step
        stats = lrn.train_on(samples)
        results.append((stats, grads_at_step))
    (big, big_g), *others = results
    assert big["micro_batches"] == 1
    for stats, accumulated in others:
        assert stats["micro_batches"] > 1
        for key in ("loss", "grad_norm", "tokens", "entropy", "behav_kl"):
            assert stats[key] == pytest.approx(big[key], rel=1e-4, abs=1e-6), key
        for name, g in accumulated.items():  # the gradient the optimizer steps on
            assert torch.allclose(g, big_g[name], atol=1e-6), name


def test_step_metrics_and_the_kl_to_the_reference_policy(model):
    lrn = learner(model, batch_size=4, kl_coef=0.5, lr=5e-2)
    batch = [make_exp(f"s{i}", response=[10 + i, 20, 30 + i, 40], advantage=1.0) for i in range(4)]
    for s in batch:
        lrn.offer(s)
    first = lrn.step().metrics
    assert {"loss", "grad_norm", "tokens", "entropy", "clip_frac", "kl_ref"} <= first.keys()
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # the reference is the initial policy
    assert first["entropy"] > 0 and first["grad_norm"] > 0 and first["tokens"] == 16
    for s in batch:
        lrn.offer(make_exp("again-" + s.sample_id, response=s.response_ids.tolist(), advantage=1.0))
    second = lrn.step().metrics
    assert second["kl_ref"] > 1e-4  # the policy moved away from the reference
    assert lrn.reference is not None and not any(p.requires_grad for p in lrn.reference.parameters())


def test_bf16_autocast_and_gradient_checkpointing(tokenizer):
    cfg = tiny_config(len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    samples = grpo_batch(seed=7)
    runs = {}
    for name, opts in (("plain", {}), ("ckpt", {"gradient_checkpointing": True}), ("bf16", {"autocast": "bf16"})):
        m = build_tiny_model(cfg, seed=3)
        lrn = Learner(m, LearnerConfig(batch_size=len(samples), lr=1e-2, micro_batch_tokens=30, **opts),
                      max_staleness=1)
        runs[name] = (lrn.train_on(samples), mean_logprob(m, samples))
    assert runs["ckpt"][0]["grad_norm"] == pytest.approx(runs["plain"][0]["grad_norm"], rel=1e-4)
    assert runs["ckpt"][1] == pytest.approx(runs["plain"][1], abs=1e-5)
    assert runs["bf16"][0]["loss"] == pytest.approx(runs["plain"][0]["loss"], rel=0.05, abs=0.02)
    assert runs["bf16"][0]["grad_norm"] == pytest.approx(runs["plain"][0]["grad_norm"], rel=0.1)


def test_lora_trains_adapters_only_and_publishes_merged_weights(tokenizer, tmp_path):
    cfg = tiny_config(len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = build_tiny_model(cfg, seed=4)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    lrn = Learner(model, LearnerConfig(batch_size=4, lr=5e-2, lora_rank=4, kl_coef=0.1), max_staleness=1)
    batch = [make_exp(f"s{i}", response=[10 + i, 20, 30 + i, 40], advantage=1.0) for i in range(4)]
    before = mean_logprob(model, batch)
    for _ in range(2):
        stats = lrn.train_on(batch)
    assert mean_logprob(model, batch) > before + 0.05 and stats["kl_ref"] > 0
    with lrn.export_model() as merged:
        exported = {k: v.clone() for k, v in merged.state_dict().items()}
    assert exported.keys() == initial.keys()  # Hugging Face names: what save_pretrained publishes
    changed = {k for k in initial if not torch.equal(initial[k], exported[k])}
    assert changed and all(k.split(".")[-2] in lora.TARGETS for k in changed)
    # the base weights come back exactly after the merge; the merged model computes what the adapted one does
    assert all(torch.equal(a.base.weight, initial[n + ".weight"]) for n, a in lora.adapters(model).items())
    plain = build_tiny_model(cfg, seed=4)
    plain.load_state_dict(exported)
    assert mean_logprob(plain, batch) == pytest.approx(mean_logprob(model, batch), abs=1e-5)
    # a checkpoint (merged weights + adapter tensors) restores the same learner
    state = lrn.state_dict()
    again = Learner(build_tiny_model(cfg, seed=9), lrn.cfg, max_staleness=1)
    again.load_state_dict(state)
    assert mean_logprob(again.model, batch) == pytest.approx(mean_logprob(model, batch), abs=1e-5)
    for n, a in lora.adapters(again.model).items():
        assert torch.allclose(a.base.weight, initial[n + ".weight"], atol=1e-6)


# -- staleness, de-duplication, ledger -------------------------------------------------------------------

def learner(model, **cfg) -> Learner:
    return Learner(model, LearnerConfig(**{"batch_size": 2, "lr": 1e-2, **cfg}), max_staleness=1)


def test_samples_beyond_the_staleness_bound_are_dropped_with_their_reason(model):
    lrn = learner(model, batch_size=3)
    lrn.version = 3
    assert lrn.offer(make_exp("fresh", versions=[3, 3, 3, 3])) == "train"
    assert lrn.offer(make_exp("bound", versions=[2, 2, 3, 3])) == "train"  # staleness 1 == bound
    assert lrn.offer(make_exp("old", versions=[1, 1, 1, 1])) == "dropped_stale"
    assert lrn.offer(make_exp("spans", versions=[3, 3, 1, 3])) == "dropped_stale"  # min over model tokens
    # observation tokens (mask 0, version -1) do not count towards the sample's age
    assert lrn.offer(make_exp("obs", versions=[3, -1, 3, 3], mask=[1, 0, 1, 1])) == "train"
    # stale wins over filtered, so an evicted id coming back late can only be dropped
    assert lrn.offer(make_exp("old-filtered", versions=[0] * 4, filtered="zero_variance")) == "dropped_stale"
    report = lrn.step()
    assert report.trained == ("fresh", "bound", "obs")
    assert report.dropped_stale == ("old", "spans", "old-filtered")
    assert report.version == 3
    assert lrn.ledger.reasons == {"stale": 3}


def test_duplicates_are_counted_apart_and_never_trained_twice(model):
    lrn = learner(model)
    assert lrn.offer(make_exp("a"), ("t", 0), 0) == "train"
    assert lrn.offer(make_exp("a"), ("t", 0), 1) == "duplicate"  # re-emitted inside the same batch
    assert lrn.offer(make_exp("f", filtered="zero_variance"), ("t", 1), 0) == "filtered"
    assert lrn.offer(make_exp("b"), ("t", 0), 2) == "train"
    first = lrn.step()
    assert first.trained == ("a", "b") and first.filtered == ("f",) and first.duplicates == 1
    assert first.offsets == {("t", 0): 3, ("t", 1): 1}
    # later re-emissions of a trained or a filtered sample
    assert lrn.offer(make_exp("a"), ("t", 0), 3) == "duplicate"
    assert lrn.offer(make_exp("f", filtered="zero_variance"), ("t", 1), 1) == "duplicate"
    assert lrn.ledger.to_dict() | {"reasons": {}} == {
        "trained": 2, "dropped_stale": 0, "filtered": 1, "duplicates": 1, "consumed": 3, "reasons": {}}


def test_records_are_consumed_only_when_a_step_completes(model):
    lrn = learner(model, batch_size=3)
    lrn.offer(make_exp("a"), ("t", 0), 0)
    lrn.offer(make_exp("f", filtered="straggler"), ("t", 0), 1)
    lrn.offer(make_exp("b"), ("t", 0), 2)
    assert not lrn.ready and lrn.pending == 3
    assert lrn.ledger.consumed == 0 and lrn.offsets == {} and "a" not in lrn.seen
    with pytest.raises(RuntimeError, match="needs 3 trainable"):
        lrn.step()
    lrn.offer(make_exp("c"), ("t", 0), 3)
    report = lrn.step()
    assert lrn.ledger.consumed == 4 and lrn.ledger.trained == 3 and lrn.ledger.filtered == 1
    assert lrn.offsets == {("t", 0): 4} and report.step == 1 and lrn.pending == 0
    assert lrn.ledger.reasons == {"straggler": 1}


def test_version_counts_publications():
    cfg = LearnerConfig(batch_size=1, publish_every=2)
    tok = build_char_tokenizer()
    lrn = Learner(build_tiny_model(tiny_config(len(tok), hidden_size=16, intermediate_size=32, num_layers=1,
                                               num_heads=2, num_kv_heads=1)), cfg, max_staleness=5)
    publishes = []
    for i in range(4):
        lrn.offer(make_exp(f"s{i}"))
        publishes.append(lrn.step().publish)
    assert publishes == [False, True, False, True] and lrn.version == 2 and lrn.step_count == 4


def test_seen_ids_are_not_forgotten_by_age_only_by_the_cap():
    # a regenerated copy of an old sample comes back with new versions: its id must still be known
    seen = SeenIds(max_ids=3)
    for i, v in enumerate([0, 1, 2]):
        seen.add(f"s{i}", v)
    assert seen.evict(version=9, max_staleness=1) == 0
    assert all(f"s{i}" in seen for i in range(3))
    seen.add("s3", 3)
    assert seen.evict(version=9, max_staleness=1) == 1
    assert len(seen) == 3 and "s0" not in seen  # the cap evicts the oldest version first


@pytest.mark.parametrize("objective", ["tis", "decoupled_ppo"])
def test_a_step_on_positive_advantage_samples_raises_their_logprob(model, objective):
    lrn = learner(model, batch_size=4, objective=objective)
    batch = [make_exp(f"s{i}", response=[10 + i, 20, 30 + i, 40], advantage=1.0) for i in range(4)]
    before = mean_logprob(model, batch)
    for s in batch:
        lrn.offer(s)
    lrn.step()
    assert mean_logprob(model, batch) > before + 0.1


def test_a_step_on_negative_advantage_samples_lowers_their_logprob(model):
    lrn = learner(model, batch_size=2)
    batch = [make_exp(f"s{i}", advantage=-1.0) for i in range(2)]
    before = mean_logprob(model, batch)
    for s in batch:
        lrn.offer(s)
    lrn.step()
    assert mean_logprob(model, batch) < before - 0.1


# -- state -------------------------------------------------------------------------------------------

def test_checkpoint_round_trip_restores_model_optimizer_and_progress(model, tokenizer, tmp_path):
    lrn = learner(model)
    for i in range(2):
        lrn.offer(make_exp(f"s{i}"), ("t", 0), i)
    lrn.offer(make_exp("f", filtered="zero_variance"), ("t", 2), 7)
    lrn.step()
    lrn.offer(make_exp("pending"), ("t", 0), 2)  # read but not stepped: not in the checkpoint
    store = CheckpointStore(tmp_path, keep=2)
    (tmp_path / ".tmp-step-00000009-v000009-dead").mkdir()  # a crash mid-write
    path = store.save(model, tokenizer, lrn.optimizer.state_dict(), lrn.progress())
    assert path.name == "step-00000001-v000001" and store.latest() == path
    store.remove_partial()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]

    ckpt = store.load(path)
    restored = Learner(ckpt.model, lrn.cfg, max_staleness=1)
    restored.optimizer.load_state_dict(ckpt.optimizer)
    restored.restore_progress(ckpt.progress)
    assert restored.progress() == lrn.progress()
    assert restored.offsets == {("t", 0): 2, ("t", 2): 8} and restored.pending == 0
    assert "s0" in restored.seen and "pending" not in restored.seen
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ckpt.model.state_dict()[name])
    assert restored.optimizer.state_dict()["state"].keys() == lrn.optimizer.state_dict()["state"].keys()


def test_checkpoint_store_keeps_the_newest(model, tokenizer, tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    lrn = learner(model)
    for step in (1, 2, 3):
        lrn.step_count = lrn.version = step
        store.save(model, tokenizer, lrn.optimizer.state_dict(), lrn.progress())
    assert [p.name for p in store.list()] == ["step-00000002-v000002", "step-00000003-v000003"]


def test_sft_warm_start_raises_the_logprob_of_the_demonstrations(model, tokenizer):
    demos = [(f"{a}+{b}=", str(a + b)) for a in range(3) for b in range(3)]
    samples = [make_exp(p, prompt=tokenizer.encode(p, add_special_tokens=False),
                        response=tokenizer.encode(c, add_special_tokens=False) + [tokenizer.eos_token_id])
               for p, c in demos]
    before = mean_logprob(model, samples)
    sft_warm_start(model, tokenizer, demos, steps=30, lr=1e-2, seed=0)
    assert mean_logprob(model, samples) > before + 1.0
    assert not model.training
