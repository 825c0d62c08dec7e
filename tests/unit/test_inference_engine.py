"""The local engine in-process: ragged batched forward, chunked prefill, sampling, request parsing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from modelserver.local.engine import LocalEngine, Sequence
from modelserver.local.protocol import BadRequest, SamplingParams, ValidationFailed, parse_generate_request
from modelserver.local.runner import PagedRunner, SlotRunner, UnsupportedModel
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model_and_tokenizer(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    tok = build_char_tokenizer()
    return build_tiny_model(tiny_config(len(tok), attn_implementation=request.param), seed=0), tok


def _runner(kind: str, model, **kw):  # type: ignore[no-untyped-def]
    """A small store that grows mid-test: slot capacity 4, or a paged pool of 3-token blocks starting at 2 blocks."""
    if kind == "slot":
        return SlotRunner(model, max_slots=8, initial_capacity=4, **kw)
    return PagedRunner(model, max_seqs=8, max_tokens=3 * 64, block_size=3, initial_tokens=6, **kw)


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_chunked_prefill_and_batched_decode_match_full_forward(model_and_tokenizer, kind: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = model_and_tokenizer
    runner = _runner(kind, model)
    prompts = [tok.encode(p) for p in ("def f(x):", "1+2=", "ls -la /tmp && echo hi", "a")]
    spare = runner.acquire()  # rows 1..4: the decode batch is not slots 0..B-1 (the index_select path)
    slots = [runner.acquire() for _ in prompts]
    last: list[torch.Tensor] = []
    for slot, prompt in zip(slots, prompts):
        done, logits = 0, None
        while done < len(prompt):  # chunks of 3 against the growing cache
            chunk = prompt[done : done + 3]
            logits = runner.prefill(slot, done, chunk)
            done += len(chunk)
        assert logits is not None
        last.append(logits)
    seqs = [list(p) for p in prompts]
    for _ in range(4):  # batched decode of sequences of different lengths
        toks = [int(torch.argmax(t)) for t in last]
        for s, t in zip(seqs, toks):
            s.append(t)
        last = list(runner.decode(slots, [len(s) - 1 for s in seqs], toks))
    runner.release(spare)
    with torch.no_grad():
        for s, got in zip(seqs, last):
            want = model(input_ids=torch.tensor([s])).logits[0, -1]
            assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_copied_prefix_continues_like_the_source(model_and_tokenizer, kind: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = model_and_tokenizer
    runner = _runner(kind, model)
    prompt = tok.encode("# write f: add 3\n")
    a, b = runner.acquire(), runner.acquire()
    want = runner.prefill(a, 0, prompt)
    runner.copy_prefix(b, a, len(prompt) - 1)
    got = runner.decode([b], [len(prompt) - 1], [prompt[-1]])[0]
    assert want is not None and torch.allclose(got, want, atol=1e-5)


def test_unsupported_architecture_is_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    with pytest.raises(UnsupportedModel, match="gpt2"):
        SlotRunner(model)


async def _run(engine: LocalEngine, seq: Sequence) -> Sequence:
    while not seq.finished:
        await seq.wait_changed()
    return seq


@pytest.mark.anyio
async def test_engine_chunked_prefill_and_batching_agree(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    model, tok = model_and_tokenizer
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [tok.encode("x" * n + "=1") for n in (1, 5, 40, 90)]
    outputs = []
    for chunk, batch in ((1000, 1), (7, 4)):
        engine = LocalEngine(model, tok, max_batch=batch, chunk_size=chunk)
        await engine.start()
        try:
            seqs = [engine.submit(p, params) for p in prompts]
            done = await asyncio.wait_for(asyncio.gather(*(_run(engine, s) for s in seqs)), 60)
            outputs.append([s.output_ids for s in done])
            assert all(s.finish_reason == {"type": "length", "length": 8} for s in done)
        finally:
            await engine.aclose()
    assert outputs[0] == outputs[1]


@pytest.mark.anyio
async def test_a_group_computes_its_shared_prompt_once(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Eight samples of one prompt: seven copy the first one's prefix, and sample exactly as alone."""
    model, tok = model_and_tokenizer
    prompt = tok.encode("# goal: create a.txt containing hi\n$ ")
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, sampling_seed=i) for i in range(8)]
    engine = LocalEngine(model, tok, max_batch=8, chunk_size=512)
    await engine.start()
    try:
        group = [engine.submit(prompt, p) for p in params]
        await asyncio.wait_for(asyncio.gather(*(_run(engine, s) for s in group)), 60)
        assert sorted(s.cached_tokens for s in group) == [0] + [len(prompt) - 1] * 7
        assert engine.statistics().prefill_tokens == len(prompt)  # the prompt once; the copies decode their last token
        alone = []
        for p in params:
            alone.append(await asyncio.wait_for(_run(engine, engine.submit(prompt, p)), 30))
    finally:
        await engine.aclose()
    for shared, single in zip(group, alone):
        assert shared.output_ids == single.output_ids
        assert shared.logprobs == pytest.approx(single.logprobs, abs=1e-4)


@pytest.mark.anyio
async def test_engine_sampling_params_and_logprob_convention(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    model, tok = model_and_tokenizer
    engine = LocalEngine(model, tok, max_batch=4, chunk_size=64)
    await engine.start()
    try:
        prompt = tok.encode("abc")
        hot = SamplingParams(max_new_tokens=1, temperature=2.0, sampling_seed=1)
        seq = await asyncio.wait_for(_run(engine, engine.submit(prompt, hot)), 30)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        expected = torch.log_softmax(logits / 2.0, dim=-1)[seq.output_ids[0]]
        assert seq.logprobs[0] == pytest.approx(float(expected), abs=1e-4)  # log_softmax(logits / T)

        top1 = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1, sampling_seed=5)
        seq = await asyncio.wait_for(_run(engine, engine.submit(prompt, top1)), 30)
        assert seq.output_ids == [int(torch.argmax(logits))]

        # every token but <pad> <s> <unk> stops; min_new_tokens masks the stops (and eos) for all 5 steps
        forced = SamplingParams(max_new_tokens=5, min_new_tokens=5, temperature=1.0, stop_token_ids=tuple(range(4, 101)), sampling_seed=2)
        seq = await asyncio.wait_for(_run(engine, engine.submit(prompt, forced)), 30)
        assert set(seq.output_ids) <= {0, 1, 3} and seq.finish_reason == {"type": "length", "length": 5}
        assert all(lp > float("-inf") for lp in seq.logprobs)

        zero = engine.submit(prompt, SamplingParams(max_new_tokens=0))
        assert zero.finished and zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}
        with pytest.raises(BadRequest, match="context length"):
            engine.submit([5] * engine.context_length, SamplingParams())
    finally:
        await engine.aclose()


def test_parse_generate_request_normalises_and_validates() -> None:
    req = parse_generate_request({"text": ["a", "b"], "rid": ["r1", "r2"], "sampling_params": {"stop": "x"}}, vocab_size=10)
    assert req.is_batch and req.size == 2 and req.rids == ["r1", "r2"] and req.sampling.stop == ("x",)
    req = parse_generate_request({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4.0}}, vocab_size=10)
    assert not req.is_batch and req.input_ids == [[1, 2]] and req.sampling.max_new_tokens == 4
    with pytest.raises(BadRequest, match="rid"):
        parse_generate_request({"text": ["a", "b"], "rid": "r"}, vocab_size=10)
    with pytest.raises(ValidationFailed):
        parse_generate_request({"input_ids": [1, True]}, vocab_size=10)
    with pytest.raises(BadRequest, match="unknown parameter"):
        parse_generate_request({"text": "a", "sampling_params": {"temprature": 1}}, vocab_size=10)
    with pytest.raises(BadRequest, match="stop_token_ids"):
        parse_generate_request({"text": "a", "sampling_params": {"stop_token_ids": [99]}}, vocab_size=10)
    assert ValidationFailed("m").body() == {"object": "error", "message": "m", "type": "Bad Request", "param": None, "code": 400}
    assert BadRequest("m").body() == {"error": {"message": "m"}}


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_packed_step_matches_full_forward(model_and_tokenizer, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Prefill chunks of several sequences and decode rows in one packed pass give each its own logits."""
    model, tok = model_and_tokenizer
    runner = _runner(kind, model)
    prompts = [tok.encode(p) for p in ("def f(x):", "1+2=", "ls -la /tmp && echo hi")]
    slots = [runner.acquire() for _ in prompts]
    seqs = [list(p) for p in prompts]
    done = [0, 0, 0]
    # step 1: first chunks of all three (different lengths); step 2: rest of #2 + its neighbours decode
    pre, dec = runner.step([(slots[i], 0, prompts[i][:5]) for i in range(3)], [], [], [])
    assert dec is None and len(pre) == 3
    done = [min(5, len(p)) for p in prompts]
    last = {i: pre[i] for i in range(3) if done[i] == len(prompts[i])}
    for _ in range(4):
        chunks = [(i, prompts[i][done[i]:done[i] + 6]) for i in range(3) if done[i] < len(prompts[i])]
        dec_rows = [i for i in range(3) if done[i] >= len(prompts[i])]
        toks = [int(torch.argmax(last[i])) for i in dec_rows]
        for i, t in zip(dec_rows, toks):
            seqs[i].append(t)
        pre, dec = runner.step([(slots[i], done[i], c) for i, c in chunks], [slots[i] for i in dec_rows],
                               [len(seqs[i]) - 1 for i in dec_rows], toks)
        for (i, c), logits in zip(chunks, pre):
            done[i] += len(c)
            if done[i] == len(prompts[i]):
                last[i] = logits
        for i, row in zip(dec_rows, dec if dec is not None else []):
            last[i] = row
    assert all(d == len(p) for d, p in zip(done, prompts))
    with torch.no_grad():
        for i, s in enumerate(seqs):
            want = model(input_ids=torch.tensor([s])).logits[0, -1]
            assert torch.allclose(last[i], want, atol=1e-4)


@pytest.mark.anyio
async def test_bf16_serving_is_seeded_and_close_to_fp32() -> None:
    """bf16 weights and cache: a seed still reproduces, logprobs are fp32 numbers near the fp32 model's."""
    from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config

    tok = build_char_tokenizer()
    reference = build_tiny_model(tiny_config(len(tok)), seed=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LocalEngine(reference, tok, dtype="fp8")
    engine = LocalEngine(build_tiny_model(tiny_config(len(tok)), seed=0), tok, max_batch=4, dtype="bf16")
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    prompt = tok.encode("def f(x):")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, sampling_seed=3)
    await engine.start()
    try:
        first, second = [await asyncio.wait_for(_run(engine, engine.submit(prompt, params)), 30) for _ in range(2)]
    finally:
        await engine.aclose()
    assert first.output_ids == second.output_ids and first.logprobs == second.logprobs
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt + first.output_ids])).logits[0]
    want = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    got = torch.tensor(first.logprobs)
    expected = want[torch.arange(len(first.output_ids)), torch.tensor(first.output_ids)]
    assert torch.allclose(got, expected, atol=0.1)  # bf16 rounding of an 8-bit mantissa, not a different model
