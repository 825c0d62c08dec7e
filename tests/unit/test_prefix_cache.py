"""The local engine's retained prefix cache and its sliding-window attention option (tiny char model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from modelserver.local.engine import LocalEngine, Sequence
from modelserver.local.prefix_cache import PrefixCache, common_prefix
from modelserver.local.protocol import SamplingParams
from modelserver.local.runner import SlotRunner
from modelserver.llm import build_char_tokenizer, build_tiny_model, save_model_dir, tiny_config

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def tok():  # type: ignore[no-untyped-def]
    return build_char_tokenizer()


def _model(tok, seed: int = 0):  # type: ignore[no-untyped-def]
    return build_tiny_model(tiny_config(len(tok)), seed=seed)


async def _generate(engine: LocalEngine, prompt: list[int], params: SamplingParams = GREEDY) -> Sequence:
    seq = engine.submit(prompt, params)
    async with asyncio.timeout(60):
        while not seq.finished:
            await seq.wait_changed()
    return seq


# ------------------------------------------------------------------------ the cache itself


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 9, 5], [1, 2, 3, 4, 5]) == 3
    assert common_prefix([7], [1]) == 0 and common_prefix([], [1]) == 0
    assert common_prefix(list(range(1000)), list(range(999)) + [0]) == 999


def test_lru_budget_supersede_and_epoch() -> None:
    cache = PrefixCache(max_tokens=10, bytes_per_token=4)

    def kv(n: int) -> torch.Tensor:
        return torch.zeros(1, 2, 1, n, 1)

    assert cache.insert([1, 2, 3, 4], kv, epoch=0)
    assert not cache.insert([1, 2, 3], kv, epoch=0)  # held inside the longer entry
    assert cache.insert([1, 2, 3, 4, 5, 6], kv, epoch=0)  # supersedes [1, 2, 3, 4]
    assert cache.statistics().entries == 1 and cache.statistics().tokens == 6
    assert cache.insert([9, 8, 7, 6], kv, epoch=0)
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], limit=6, epoch=0)[0] == 6  # refreshes [1..6]
    assert cache.insert([5, 5, 5], kv, epoch=0)  # over budget: the least recently used ([9, 8, 7, 6]) goes
    assert cache.lookup([9, 8, 7, 6], limit=3, epoch=0) == (0, None)
    assert cache.lookup([1, 2, 3, 4, 5, 6], limit=4, epoch=0)[0] == 4  # limited to what the caller may reuse
    assert cache.lookup([1, 2, 3], limit=2, epoch=1) == (0, None)  # another weights epoch: never served
    assert not cache.insert(list(range(11)), kv, epoch=0)  # longer than the whole budget
    stats = cache.statistics()
    assert stats.tokens == 9 and stats.bytes == 9 * 2 * 4 and stats.evicted_tokens == 4
    assert cache.clear() == 9 and cache.statistics().tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(max_tokens=-1, bytes_per_token=4)


# ------------------------------------------------------------------------ in the engine


@pytest.mark.anyio
async def test_greedy_outputs_are_identical_with_and_without_the_cache(tok) -> None:  # type: ignore[no-untyped-def]
    model = _model(tok)
    first_turn = tok.encode("# task: print the sum of 2 and 3\n$ ")
    prompts = [first_turn, first_turn]  # the same prompt again
    outputs: dict[int, list[Sequence]] = {}
    for budget in (0, 4096):
        engine = LocalEngine(model, tok, max_batch=4, chunk_size=16, prefix_cache_tokens=budget)
        await engine.start()
        try:
            seqs = [await _generate(engine, p) for p in prompts]
            # a multi-turn episode: the next turn's prompt extends the last prompt + output
            second_turn = first_turn + seqs[0].output_ids + tok.encode("\nok, now 4 and 5\n$ ")
            seqs.append(await _generate(engine, second_turn))
            outputs[budget] = seqs
            stats = engine.statistics()
        finally:
            await engine.aclose()
        if budget:
            assert stats.prefix_cache_hits == 2 and stats.prefix_cache_hit_tokens > len(first_turn)
            assert stats.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # layers x (k, v) x kv_heads x head_dim x fp32
            # the paged store holds whole blocks: a partly filled last block counts in bytes, not in tokens
            block = max(1, stats.kv_block_size)
            assert stats.prefix_cache_tokens * stats.kv_bytes_per_token <= stats.prefix_cache_bytes
            assert stats.prefix_cache_bytes < (stats.prefix_cache_tokens + 2 * block) * stats.kv_bytes_per_token
        else:
            assert stats.prefix_cache_hits == 0 and stats.prefix_cache_tokens == 0
    uncached, cached = outputs[0], outputs[4096]
    assert [s.cached_tokens for s in uncached] == [0, 0, 0]
    assert cached[0].cached_tokens == 0
    assert cached[1].cached_tokens == len(first_turn) - 1  # all but the last prompt token (its logits are needed)
    assert cached[2].cached_tokens == len(first_turn) + len(cached[0].output_ids) - 1
    for a, b in zip(uncached, cached):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.anyio
async def test_a_weight_update_prevents_reuse(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prompt = tok.encode("# goal: create a.txt containing hi\n$ ")
    other = _model(tok, seed=5)
    save_model_dir(other, tok, tmp_path / "v2")
    engine = LocalEngine(_model(tok), tok, max_batch=4, chunk_size=16)
    fresh = LocalEngine(other, tok, max_batch=4, chunk_size=16)
    await engine.start()
    await fresh.start()
    try:
        before = await _generate(engine, prompt)
        assert engine.statistics().prefix_cache_tokens > 0
        await engine.update_weights_from_disk(str(tmp_path / "v2"), weight_version="v2")
        assert engine.statistics().prefix_cache_tokens == 0
        after = await _generate(engine, prompt)
        want = await _generate(fresh, prompt)
        engine.invalidate_prefix_cache()  # an in-place change: the same rule
        again = await _generate(engine, prompt)
    finally:
        await engine.aclose()
        await fresh.aclose()
    assert after.cached_tokens == 0 and again.cached_tokens == 0
    assert after.output_ids == want.output_ids and after.output_ids != before.output_ids
    assert after.logprobs == pytest.approx(want.logprobs, abs=1e-5)


@pytest.mark.anyio
async def test_flush_is_refused_while_requests_run_and_frees_when_idle(tok) -> None:  # type: ignore[no-untyped-def]
    engine = LocalEngine(_model(tok), tok, max_batch=2, chunk_size=16)
    prompt = tok.encode("echo the prefix cache\n")
    await engine.start()
    try:
        await _generate(engine, prompt)
        running = engine.submit(prompt, SamplingParams(max_new_tokens=3000, temperature=0.0, ignore_eos=True))
        await running.wait_changed()
        assert not running.finished
        assert engine.flush_cache() is False  # SGLang refuses while requests run or wait
        assert engine.statistics().prefix_cache_tokens > 0
        engine.abort(running.rid)
        while not running.finished:
            await running.wait_changed()
        assert engine.flush_cache() is True
        stats = engine.statistics()
        assert stats.prefix_cache_tokens == 0 and stats.prefix_cache_flushes == 1
        assert (await _generate(engine, prompt)).cached_tokens == 0
    finally:
        await engine.aclose()


def test_prefix_sharing_can_be_switched_off(tok) -> None:  # type: ignore[no-untyped-def]
    engine = LocalEngine(_model(tok), tok, prefix_sharing=False)
    assert not engine.prefix_cache.enabled
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        LocalEngine(_model(tok), tok, prefix_cache_tokens=-1)


# ------------------------------------------------------------------------ sliding window


def _run_runner(runner: SlotRunner, prompt: list[int], chunk: int, steps: int) -> list[torch.Tensor]:
    """Chunked prefill then greedy decode of one sequence; the logits of every generated position."""
    slot = runner.acquire()
    done, logits = 0, None
    while done < len(prompt):
        logits = runner.prefill(slot, done, prompt[done: done + chunk])
        done += len(prompt[done: done + chunk])
    assert logits is not None
    out = [logits]
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(torch.argmax(out[-1])))
        out.append(runner.decode([slot], [len(seq) - 1], [seq[-1]])[0])
    runner.release(slot)
    return out


def test_a_window_larger_than_the_context_is_full_attention_exactly(tok) -> None:  # type: ignore[no-untyped-def]
    model = _model(tok)
    prompt = tok.encode("x = [i * i for i in range(10)]\nprint(sum(x))\n")
    full = _run_runner(SlotRunner(model, max_slots=2), prompt, chunk=7, steps=6)
    wide = _run_runner(SlotRunner(model, max_slots=2, attention_window=len(prompt) + 6, attention_sinks=2),
                       prompt, chunk=7, steps=6)
    assert all(torch.equal(a, b) for a, b in zip(full, wide))


def test_a_small_window_changes_attention_consistently_in_prefill_and_decode(tok) -> None:  # type: ignore[no-untyped-def]
    model = _model(tok)
    prompt = tok.encode("x = [i * i for i in range(10)]\nprint(sum(x))\n")
    full = _run_runner(SlotRunner(model, max_slots=2), prompt, chunk=64, steps=4)
    narrow = SlotRunner(model, max_slots=2, attention_window=8, attention_sinks=2)
    one_pass = _run_runner(narrow, prompt, chunk=64, steps=4)
    chunked = _run_runner(narrow, prompt, chunk=5, steps=4)
    assert not torch.allclose(full[0], one_pass[0], atol=1e-3)  # the window is applied
    for a, b in zip(one_pass, chunked):  # the same window whichever path computed the positions
        assert torch.allclose(a, b, atol=1e-4)
    # the reference: the model's own attention with a window-and-sink mask is what the runner computes
    ids = torch.tensor([prompt])
    n = len(prompt)
    q, k = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    visible = (k <= q) & ((k > q - 8) | (k < 2))
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[0, -1]
    assert torch.allclose(one_pass[0], want, atol=1e-4)
    with pytest.raises(ValueError, match="attention_window"):
        SlotRunner(model, attention_window=0)


# ------------------------------------------------------------------------ the int8 tier


def test_int8_round_trip_is_close_and_four_times_smaller() -> None:
    from modelserver.local.prefix_cache import dequantize_int8, quantize_int8

    kv = torch.randn(2, 2, 3, 50, 64)
    q, scale = quantize_int8(kv)
    back = dequantize_int8(q, scale, torch.float32)
    assert q.dtype == torch.int8 and back.shape == kv.shape
    # symmetric rounding: at most half a step (amax / 127 / 2) per element
    assert ((back - kv).abs() <= scale / 2 + 1e-6).all()
    assert (q.numel() + scale.numel() * 4) / (kv.numel() * 4) < 0.27


def test_evicted_entries_move_to_the_int8_tier_and_come_back_on_a_hit() -> None:
    cache = PrefixCache(max_tokens=8, bytes_per_token=4, int8_tokens=8)
    kvs = {n: torch.randn(1, 2, 1, n, 4) for n in (5, 6)}
    assert cache.insert([1, 2, 3, 4, 5], lambda n: kvs[5][:, :, :, :n], epoch=0)
    assert cache.insert([9, 8, 7, 6, 5, 4], lambda n: kvs[6][:, :, :, :n], epoch=0)  # evicts [1..5] to int8
    stats = cache.statistics()
    assert (stats.tokens, stats.int8_tokens, stats.int8_entries) == (6, 5, 1)
    assert stats.int8_bytes == 5 * 2 * 4 + 5 * 2 * 4  # int8 elements + one fp32 scale per (k|v, position)
    n, kv = cache.lookup([1, 2, 3, 4, 5, 0], limit=5, epoch=0)
    assert n == 5 and kv is not None and torch.allclose(kv, kvs[5], atol=kvs[5].abs().max().item() / 127)
    stats = cache.statistics()
    assert (stats.int8_hits, stats.int8_hit_tokens) == (1, 5)
    assert (stats.tokens, stats.int8_tokens) == (5, 6)  # promoted to hot; the other one went down
    assert cache.lookup([1, 2, 3, 4, 5], limit=5, epoch=1) == (0, None)  # another epoch: never served
    assert cache.clear() == 11 and cache.statistics().int8_tokens == 0


def test_without_an_int8_tier_evicted_entries_are_gone() -> None:
    cache = PrefixCache(max_tokens=8, bytes_per_token=4)
    assert cache.insert([1, 2, 3, 4, 5], lambda n: torch.zeros(1, 2, 1, n, 4), epoch=0)
    assert cache.insert([9, 8, 7, 6, 5, 4], lambda n: torch.zeros(1, 2, 1, n, 4), epoch=0)
    assert cache.lookup([1, 2, 3, 4, 5], limit=5, epoch=0) == (0, None)
    assert cache.statistics().int8_tokens == 0 and cache.statistics().evicted_tokens == 5


@pytest.mark.anyio
async def test_engine_serves_a_prefix_back_from_the_int8_tier(tok) -> None:  # type: ignore[no-untyped-def]
    model = _model(tok)
    a, b = tok.encode("# task: print the sum of 2 and 3\n$ "), tok.encode("# goal: list the files here\n$ ")
    budget = len(a) + 10 + 4  # room for one finished sequence in the hot tier
    engine = LocalEngine(model, tok, max_batch=4, chunk_size=16, prefix_cache_tokens=budget,
                         prefix_cache_int8_tokens=4 * budget)
    await engine.start()
    try:
        first = await _generate(engine, a)
        await _generate(engine, b)  # pushes a's entry down to int8
        assert engine.statistics().prefix_cache_int8_tokens > 0
        again = await _generate(engine, a)
        stats = engine.statistics()
    finally:
        await engine.aclose()
    assert stats.prefix_cache_int8_hits == 1 and again.cached_tokens == len(a) - 1
    # the tiny model's greedy choice is robust to int8 keys and values on this prompt
    assert again.output_ids == first.output_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=0.05)


def test_an_int8_only_tier_keeps_an_entry_a_hit_used_part_of() -> None:
    """Below the paged store's tree there is no hot tier: a hit on a prefix must not drop the rest of the entry."""
    cache = PrefixCache(0, bytes_per_token=4, int8_tokens=32, int8_only=True)
    kv = torch.randn(1, 2, 1, 8, 4)
    assert cache.store_int8([1, 2, 3, 4, 5, 6, 7, 8], lambda n: kv[:, :, :, :n], epoch=0)
    assert not cache.store_int8([1, 2, 3, 4], lambda n: kv[:, :, :, :n], epoch=0)  # already held inside it
    n, got = cache.lookup([1, 2, 3, 4, 9, 9], limit=5, epoch=0, floor=2)
    assert n == 4 and got is not None
    assert cache.statistics().int8_tokens == 8  # still there for the prompt that needs all of it
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0], limit=8, epoch=0)[0] == 8
    assert cache.lookup([1, 2, 3, 9], limit=3, epoch=0, floor=3) == (0, None)  # nothing longer than the floor
    with pytest.raises(ValueError, match="no hot tier"):
        PrefixCache(16, bytes_per_token=4, int8_only=True)


def test_the_int8_tiers_evictions_go_to_disk_and_come_back_on_a_hit(tmp_path: Path) -> None:
    """Three tiers: hot -> int8 -> disk (still int8, a file each); a disk hit reads the entry back, its file
    removed; a damaged file is a miss, never a wrong answer; weight changes and close delete the files."""
    cache = PrefixCache(max_tokens=6, bytes_per_token=4, int8_tokens=6, disk_tokens=12, disk_dir=tmp_path)
    prompts = {i: [10 * i + j for j in range(5)] for i in range(1, 5)}
    kvs = {i: torch.randn(1, 2, 1, 5, 4) for i in prompts}
    for i in (1, 2, 3):  # 1 goes hot -> int8 -> disk, 2 hot -> int8, 3 stays hot
        assert cache.insert(prompts[i], lambda n, i=i: kvs[i][:, :, :, :n], epoch=0)
    stats = cache.statistics()
    assert (stats.tokens, stats.int8_tokens, stats.disk_tokens, stats.disk_entries) == (5, 5, 5, 1)
    assert cache.disk_dir is not None and cache.disk_dir.parent == tmp_path
    files = list(cache.disk_dir.iterdir())
    assert len(files) == 1 and stats.disk_bytes == 5 * 2 * 4 + 5 * 2 * 4  # int8 + a fp32 scale per position
    n, kv = cache.lookup(prompts[1] + [0], limit=5, epoch=0)
    assert n == 5 and kv is not None and torch.allclose(kv, kvs[1], atol=kvs[1].abs().max().item() / 127)
    stats = cache.statistics()
    assert (stats.disk_hits, stats.disk_hit_tokens, stats.tokens) == (1, 5, 5)  # promoted to the hot tier
    assert not files[0].exists()
    # the entry that came back pushed 3 down to int8 and 2 down to disk; a damaged file is a miss
    assert cache.statistics().disk_entries == 1
    (damaged,) = list(cache.disk_dir.iterdir())
    damaged.write_bytes(b"not a tensor file")
    assert cache.lookup(prompts[2], limit=5, epoch=0) == (0, None)
    assert cache.statistics().disk_entries == 0 and not damaged.exists()
    cache.insert(prompts[4], lambda n: kvs[4][:, :, :, :n], epoch=0)  # 1 -> int8, 3 -> disk
    assert cache.statistics().disk_entries == 1
    assert cache.lookup(prompts[3], limit=5, epoch=1) == (0, None)  # another epoch: never served
    assert cache.clear() == 15 and not any(cache.disk_dir.iterdir())
    cache.close()
    assert not cache.disk_dir.exists()


def test_a_disk_tier_needs_an_int8_tier_and_an_existing_directory(tmp_path: Path) -> None:
    assert PrefixCache(8, bytes_per_token=4, disk_tokens=16).disk_dir is None  # nothing evicts into it
    with pytest.raises(ValueError, match="is not a directory"):
        PrefixCache(8, bytes_per_token=4, int8_tokens=8, disk_tokens=16, disk_dir=tmp_path / "absent")
    from engine.config import InferenceConfig

    with pytest.raises(ValueError, match="needs prefix_cache_int8_tokens"):
        InferenceConfig(prefix_cache_disk_tokens=1024)


@pytest.mark.anyio
async def test_engine_serves_a_prefix_back_from_disk_under_the_paged_store(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The paged store's tree evicts into int8, int8 into disk; the prompt sent again is served from disk."""
    model = _model(tok)
    prompts = [tok.encode(f"# task {i}: print the sum of {i} and 3\n$ ") for i in range(3)]
    budget = len(prompts[0]) + 12
    engine = LocalEngine(model, tok, max_batch=4, chunk_size=16, prefix_cache_tokens=budget,
                         prefix_cache_int8_tokens=budget, prefix_cache_disk_tokens=4 * budget,
                         prefix_cache_disk_dir=str(tmp_path), kv_block_size=4)
    await engine.start()
    try:
        first = await _generate(engine, prompts[0])
        for p in prompts[1:]:  # each pushes the one before down a tier
            await _generate(engine, p)
        assert engine.statistics().prefix_cache_disk_tokens > 0
        again = await _generate(engine, prompts[0])
        stats = engine.statistics()
    finally:
        await engine.aclose()
    assert stats.prefix_cache_disk_hits == 1 and again.cached_tokens == len(prompts[0]) - 1
    assert again.output_ids == first.output_ids
    assert not any(tmp_path.iterdir())  # the engine's close removed its directory
