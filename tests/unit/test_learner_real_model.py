"""The learner on the real model (SmolLM2-135M-Instruct): packing is exact, and token-in-token-out holds.

The model directory comes from ``$ROLLOUT_MODEL_DIR`` or, once the model layer is there, the prepared
cache (``rollout model prepare smollm2-135m``, which ops/bootstrap.sh runs). A machine without it
fails these tests with that instruction rather than skipping them.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from modelserver.local.engine import LocalEngine
from modelserver.local.protocol import SamplingParams
from learning.core import collate, pack, packed_logprobs, response_logprobs, unpack
from modelserver.llm import load_model_dir
from engine.schemas import Experience

pytestmark = pytest.mark.timeout(300)


def real_model_dir() -> Path:
    override = os.environ.get("ROLLOUT_MODEL_DIR", "").strip()
    if override:
        return Path(override)
    try:
        from modelserver.prepare import require_model_dir  # type: ignore[import-not-found]
    except ImportError:
        pytest.fail("set ROLLOUT_MODEL_DIR to a prepared SmolLM2-135M-Instruct directory")
    return Path(require_model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def real():
    # One intra-op thread: on a small shared host, two threads spend most of a step waiting on each
    # other at every operator's barrier (measured 7x slower under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield load_model_dir(real_model_dir())
    torch.set_num_threads(threads)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _exp(sid: str, prompt: list[int], response: list[int], *, logprobs: list[float] | None = None,
         temperature: float | None = None) -> Experience:
    n = len(response)
    return Experience(sample_id=sid, task_id="t", domain="arith", prompt_ids=np.asarray(prompt, dtype=np.int32),
                      response_ids=np.asarray(response, dtype=np.int32),
                      logprobs=np.asarray(logprobs if logprobs is not None else [0.0] * n, dtype=np.float32),
                      loss_mask=np.ones(n, dtype=np.uint8), weight_versions=np.zeros(n, dtype=np.int32),
                      reward=0.0, advantage=1.0, group_size=4,
                      temperature=temperature or 1.0)


def _chat_prompt(tokenizer, question: str) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_packed_logprobs_and_gradients_match_unpacked_on_the_real_model(real):
    model, tokenizer = real
    rng = np.random.default_rng(0)
    samples = []
    for g, question in enumerate(("What is 2 + 3?", "Name a prime number.")):
        prompt = _chat_prompt(tokenizer, question)
        for k in range(3):
            response = rng.integers(100, model.config.vocab_size, size=int(rng.integers(3, 9))).tolist()
            samples.append(_exp(f"{g}-{k}", prompt, response, temperature=0.8 if g else None))
    batch = collate(samples)
    m = batch.loss_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(1)) * m
    params = [model.model.layers[0].self_attn.q_proj.weight, model.model.layers[-1].mlp.down_proj.weight,
              model.model.embed_tokens.weight]
    unpacked = response_logprobs(model, batch)
    g_unpacked = torch.autograd.grad((unpacked * weights).sum(), params)
    mbs = pack(samples, micro_batch_tokens=4096)
    assert [mb.input_ids.shape[0] for mb in mbs] == [2]  # one row per prompt
    logp, _ = packed_logprobs(model, mbs[0])
    packed = unpack(samples, mbs, [logp])
    assert torch.allclose(packed[m], unpacked[m], atol=1e-4), float((packed - unpacked)[m].abs().max())
    g_packed = torch.autograd.grad((packed * weights).sum(), params)
    for a, b in zip(g_unpacked, g_packed):  # fp32 sums in another order: relative to the gradient's norm
        assert float((a - b).norm() / a.norm()) < 1e-4


@pytest.mark.anyio
async def test_learner_scores_exactly_what_the_local_engine_sampled(real):
    """Token-in-token-out: the engine's per-token logprobs at temperature 1 are the learner's, on its ids."""
    model, tokenizer = real
    engine = LocalEngine(model, tokenizer, max_batch=4, chunk_size=64)
    await engine.start()
    try:
        prompts = [_chat_prompt(tokenizer, q) for q in ("What is 4 + 5? Answer with just the number.",
                                                       "Say hello in French.")]
        params = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=3, ignore_eos=True)
        seqs = [engine.submit(p, params) for p in prompts]

        async def finished(seq):  # type: ignore[no-untyped-def]
            while not seq.finished:
                await seq.wait_changed()
            return seq

        done = await asyncio.wait_for(asyncio.gather(*(finished(s) for s in seqs)), 240)
    finally:
        await engine.aclose()
    samples = [_exp(f"s{i}", p, list(s.output_ids), logprobs=list(s.logprobs))
               for i, (p, s) in enumerate(zip(prompts, done))]
    assert all(len(s.response_ids) == 12 for s in samples)
    with torch.no_grad():
        mbs = pack(samples, micro_batch_tokens=4096)
        learner_logp = unpack(samples, mbs, [packed_logprobs(model, mb)[0] for mb in mbs])
    for i, s in enumerate(samples):
        served = torch.from_numpy(s.logprobs)
        assert torch.allclose(learner_logp[i, :len(served)], served, atol=1e-3), \
            float((learner_logp[i, :len(served)] - served).abs().max())
