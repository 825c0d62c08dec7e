"""Train/serve mismatch: the sampling temperature travels with the sample, the local server's re-scored
logprobs equal the learner's on every same-version token (tiny model and SmolLM2-135M-Instruct, fp32,
T = 0.7), and the learner's step metrics measure the gap on same-version tokens only."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from actors.inference.actor import _Sample
from engine.config import LearnerConfig
from engine.schemas import Completion, Experience, SchemaError
from learning.core import Learner, collate, pack, packed_logprobs, score_tokens, unpack
from learning.mismatch import gap_stats, relative_gap
from modelserver.client import GenerateResult
from modelserver.llm import build_char_tokenizer, build_tiny_model, load_model_dir, tiny_config
from modelserver.local.engine import LocalEngine
from modelserver.local.protocol import SamplingParams

pytestmark = pytest.mark.timeout(300)

T = 0.7
FP32_BOUND = 1e-6
"""Same-version agreement the issue asks for: |learner - server| <= 1e-6 x max(1, |logp|)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _experience(sid: str, prompt: list[int], output: list[int], logprobs: list[float], versions: list[int],
                temperature: float = T) -> Experience:
    n = len(output)
    return Experience(sample_id=sid, task_id="t", domain="d", prompt_ids=np.asarray(prompt, np.int32),
                      response_ids=np.asarray(output, np.int32), logprobs=np.asarray(logprobs, np.float32),
                      loss_mask=np.ones(n, np.uint8), weight_versions=np.asarray(versions, np.int32),
                      reward=0.0, advantage=1.0, group_size=1, temperature=temperature)


async def _sample(model: Any, tokenizer: Any, prompts: list[list[int]], *, rescore: bool, new_tokens: int = 12,
                  version: str = "0") -> list[Experience]:
    """Generate every prompt twice at T = 0.7 in one batched engine (decode rows share forward passes)."""
    engine = LocalEngine(model, tokenizer, max_batch=8, chunk_size=32, weight_version=version,
                         rescore=score_tokens if rescore else None)
    await engine.start()
    try:
        seqs = [(p, engine.submit(p, SamplingParams(max_new_tokens=new_tokens, temperature=T, sampling_seed=i,
                                                    ignore_eos=True)))
                for i, p in enumerate(prompts * 2)]

        async def finished(seq: Any) -> Any:
            while not seq.finished:
                await seq.wait_changed()
            return seq

        await asyncio.wait_for(asyncio.gather(*(finished(s) for _, s in seqs)), 240)
    finally:
        await engine.aclose()
    return [_experience(f"s{i}", p, list(s.output_ids), list(s.logprobs), [int(v) for v in s.token_versions])
            for i, (p, s) in enumerate(seqs)]


def _learner_logprobs(model: Any, samples: list[Experience]) -> torch.Tensor:
    """What the learner computes for the samples (packed without a shared prefix), [B, R]."""
    mbs = pack(samples, micro_batch_tokens=4096, share_prefix=False)
    with torch.no_grad():
        return unpack(samples, mbs, [packed_logprobs(model, mb)[0] for mb in mbs])


def _assert_equal_on_every_token(model: Any, samples: list[Experience]) -> None:
    """The learner's scoring of each sample alone (``score_tokens``) equals what the server reported."""
    for s in samples:
        served = torch.from_numpy(s.logprobs.copy())
        ours = torch.tensor(score_tokens(model, s.prompt_ids.tolist(), s.response_ids.tolist(), s.temperature))
        assert len(served) > 0
        assert relative_gap(ours, served) <= FP32_BOUND, (s.sample_id, relative_gap(ours, served))


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tiny_config(len(tokenizer)), seed=3).eval(), tokenizer


@pytest.fixture(scope="module")
def smol() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from tests.unit.test_learner_real_model import real_model_dir

    yield load_model_dir(real_model_dir())
    torch.set_num_threads(threads)


def _chat(tokenizer: Any, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.anyio
async def test_rescored_logprobs_equal_the_learners_on_the_tiny_model(tiny) -> None:
    model, tokenizer = tiny
    prompts = [tokenizer.encode(t) for t in ("2+3=", "hello world", "abc")]
    samples = await _sample(model, tokenizer, prompts, rescore=True, new_tokens=16)
    _assert_equal_on_every_token(model, samples)
    learner = _learner_logprobs(model, samples)  # packed as the learner trains: the same here too
    for i, s in enumerate(samples):
        assert relative_gap(learner[i, :len(s.logprobs)], torch.from_numpy(s.logprobs.copy())) <= FP32_BOUND


@pytest.mark.anyio
async def test_the_mismatch_loadtests_learner_part_reports_each_packing(tiny) -> None:
    """loadtests/mismatch.py's learner part on the tiny model: both packings' gap and step time, one forward
    per sample under per_sample, and that one's gap within the bound."""
    from loadtests.mismatch import _train_steps

    model, tokenizer = tiny
    samples = await _sample(model, tokenizer, [tokenizer.encode(t) for t in ("2+3=", "abc")], rescore=True)
    got = _train_steps(model, [(s.prompt_ids.tolist(), s.response_ids.tolist(), s.logprobs.tolist())
                               for s in samples], repeats=1)
    assert got["train_micro_batches_per_sample"] == len(samples) > got["train_micro_batches_rows"]
    assert got["train_gap_per_sample_max"] <= FP32_BOUND
    assert got["per_sample_step_cost"] == got["train_step_s_per_sample"] / got["train_step_s_rows"] > 0


@pytest.mark.anyio
async def test_rescored_logprobs_equal_the_learners_on_smollm2(smol) -> None:
    model, tokenizer = smol
    prompts = [_chat(tokenizer, q) for q in ("What is 4 + 5?", "Say hello in French.", "Name a prime number.")]
    rescored = await _sample(model, tokenizer, prompts, rescore=True)
    _assert_equal_on_every_token(model, rescored)
    # the learner's step measures the gap on these same-version tokens with its training forward (each
    # learner on a copy of the served weights: a step moves them). Packed into padded rows, sdpa splits the
    # keys differently, so not bitwise (docs/learner.md's table); one forward per sample
    # (learner.packing = "per_sample") has score_tokens' shapes: equal on every token.
    tokens = sum(len(s.response_ids) for s in rescored)
    for packing, bound in (("rows", 1e-4), ("per_sample", FP32_BOUND)):
        cfg = LearnerConfig(batch_size=len(rescored), share_prefix=False, lr=1e-6, packing=packing)
        stats = Learner(copy.deepcopy(model), cfg, max_staleness=4).train_on(rescored)
        assert stats["mismatch_tokens"] == tokens and stats["micro_batches"] >= 1
        assert stats["mismatch_max"] <= bound, (packing, stats["mismatch_max"])
    assert stats["micro_batches"] == len(rescored)


@pytest.mark.anyio
async def test_decode_time_logprobs_differ_from_the_learners_without_rescoring(smol) -> None:
    """Without re-scoring, batched decode against the KV cache is not the learner's full forward: the gap
    the server option closes is real (what docs/learner.md's table reports)."""
    model, tokenizer = smol
    prompts = [_chat(tokenizer, q) for q in ("What is 4 + 5?", "Say hello in French.")]
    plain = await _sample(model, tokenizer, prompts, rescore=False)
    learner = _learner_logprobs(model, plain)
    gaps = [relative_gap(learner[i, :len(s.logprobs)], torch.from_numpy(s.logprobs.copy()))
            for i, s in enumerate(plain)]
    assert max(gaps) > FP32_BOUND
    assert max(gaps) < 1e-3


def test_the_step_measures_mismatch_on_same_version_tokens_only(tiny) -> None:
    model, _ = tiny
    prompt = [5, 6, 7]
    response = [10, 11, 12, 13]
    exact = score_tokens(model, prompt, response, T)
    off = [lp + 0.01 for lp in exact]
    # sample a: version 0 (the learner's), its tokens off by 0.01; sample b: an older version (staleness, not mismatch)
    a = _experience("a", prompt, response, off, [0, 0, 0, 0])
    b = _experience("b", prompt, response, [lp - 0.5 for lp in exact], [-1, -1, -1, -1])
    learner = Learner(model, LearnerConfig(batch_size=2, share_prefix=False, lr=1e-12), max_staleness=4)
    stats = learner.train_on([a, b])
    assert stats["mismatch_tokens"] == 4
    assert stats["mismatch_max"] == pytest.approx(0.01, abs=1e-5)
    assert stats["mismatch_p50"] == pytest.approx(0.01, abs=1e-5)
    assert stats["behav_kl"] != 0.0  # the stale sample's part stays in behav_kl


def test_publish_every_above_one_measures_only_right_after_a_publication(tiny) -> None:
    model, _ = tiny
    exact = score_tokens(model, [5, 6], [9, 8, 7], T)
    learner = Learner(model, LearnerConfig(batch_size=1, publish_every=2, share_prefix=False, lr=1e-12),
                      max_staleness=4)
    assert learner.serves_own_version
    learner.step_count = 1  # one step past the publication: the weights are no longer version 0's
    assert not learner.serves_own_version
    stats = learner.train_on([_experience("a", [5, 6], [9, 8, 7], exact, [0, 0, 0])])
    assert stats["mismatch_tokens"] == 0.0


def test_gap_stats_quantiles() -> None:
    stats = gap_stats([torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0, 4.0])])
    assert stats == {"mismatch_p50": 2.0, "mismatch_p99": pytest.approx(3.96), "mismatch_max": 4.0,
                     "mismatch_tokens": 5.0}
    assert gap_stats([]) == {"mismatch_tokens": 0.0}


# -- the temperature travels with the sample ---------------------------------------------------------

def test_temperature_is_carried_and_applied_by_the_learner(tiny) -> None:
    model, _ = tiny
    exp = _experience("a", [5, 6, 7], [10, 11], [0.0, 0.0], [0, 0], temperature=T)
    decoded = Experience.from_body(exp.to_body())
    assert isinstance(decoded, Experience) and decoded.temperature == T
    assert "temperature" not in dataclasses.replace(exp, temperature=1.0).to_body()  # old readers still read T=1
    batch = collate([decoded])
    assert batch.temperature.flatten().tolist() == [pytest.approx(T)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7, 10]])).logits[0].float()
    by_hand = torch.log_softmax(logits / T, dim=-1)
    expected = [float(by_hand[2, 10]), float(by_hand[3, 11])]
    assert score_tokens(model, [5, 6, 7], [10, 11], T) == pytest.approx(expected, abs=1e-5)
    assert score_tokens(model, [5, 6, 7], [10, 11], 1.0) != pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_a_sample_without_a_positive_temperature_is_refused_with_its_reason(bad: float) -> None:
    exp = _experience("a", [5], [10], [0.0], [0])
    body = exp.to_body()
    body["temperature"] = bad
    with pytest.raises(SchemaError, match=r"experience\.temperature: must be a finite number > 0"):
        Experience.from_body(body)
    comp = Completion(sample_id="a", task_id="t", domain="d", group_index=0, group_size=1,
                      prompt_ids=np.asarray([5], np.int32), response_ids=np.asarray([10], np.int32),
                      logprobs=np.zeros(1, np.float32), loss_mask=np.ones(1, np.uint8),
                      weight_versions=np.zeros(1, np.int32), text="", finish_reason="stop", temperature=bad)
    with pytest.raises(SchemaError, match=r"completion\.temperature"):
        comp.validate()


def test_the_final_chunk_replaces_the_streamed_logprobs() -> None:
    sample = _Sample("s")
    sample.add_observation([1, 2])
    sample.add_model_tokens([3, 4], [-1.0, -2.0], [0, 0])
    final = GenerateResult(text="", output_ids=[3, 4], logprobs=[-1.5, -2.5], finish_reason={"type": "stop"},
                           weight_version="0", prompt_tokens=2, completion_tokens=2, token_weight_versions=["0", "0"])
    sample.take_final_logprobs(final, 2)
    assert sample.logprobs == [0.0, 0.0, -1.5, -2.5]
