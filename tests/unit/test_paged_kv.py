"""The paged KV store: block tables, shared prefix blocks, the radix tree over blocks, admission on free blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from modelserver.local.engine import LocalEngine, Sequence
from modelserver.local.protocol import BadRequest, SamplingParams
from modelserver.local.radix import BlockRadix
from modelserver.local.runner import OutOfBlocks, PagedRunner
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):  # type: ignore[no-untyped-def]
    return build_tiny_model(tiny_config(len(tok)), seed=0)


async def _finish(seq: Sequence) -> Sequence:
    async with asyncio.timeout(60):
        while not seq.finished:
            await seq.wait_changed()
    return seq


async def _most(engine: LocalEngine, seqs: list[Sequence], statistic: str) -> int:
    """Wait for ``seqs`` to finish; the highest value the engine's ``statistic`` took on the way."""
    most = 0
    async with asyncio.timeout(120):
        while not all(s.finished for s in seqs):
            most = max(most, getattr(engine.statistics(), statistic))
            await next(s for s in seqs if not s.finished).wait_changed()  # the next token or finish
    return most


# ------------------------------------------------------------------------ the runner's blocks


def test_blocks_are_shared_reference_counted_and_bounded(model) -> None:  # type: ignore[no-untyped-def]
    runner = PagedRunner(model, max_seqs=4, max_tokens=4 * 8, block_size=4, initial_tokens=4)
    a, b = runner.acquire(), runner.acquire()
    runner.prefill(a, 0, list(range(10, 20)))  # 10 tokens: blocks 0..2 (the last one half full)
    assert len(runner.tables.table(a)) == 3 and runner.pool.free_blocks == 5
    runner.copy_prefix(b, a, 10)
    shared, own = runner.tables.table(b)[:2], runner.tables.table(b)[2]
    assert shared == runner.tables.table(a)[:2] and own != runner.tables.table(a)[2]  # full blocks shared, the partial one copied
    assert [runner.pool.refcount(x) for x in shared] == [2, 2] and runner.pool.free_blocks == 4
    for layer in range(len(runner.k)):  # the copied half block holds the source's keys and values
        src, dst = runner.tables.table(a)[2] * 4, own * 4
        assert torch.equal(runner.k[layer][dst:dst + 2], runner.k[layer][src:src + 2])
    runner.release(a)
    assert [runner.pool.refcount(x) for x in shared] == [1, 1] and runner.pool.free_blocks == 5  # a's own block came back
    c = runner.acquire()
    with pytest.raises(OutOfBlocks, match="8 KV blocks"):
        runner.prefill(c, 0, list(range(30)))  # 8 blocks wanted, 5 free
    runner.release(b)
    runner.release(c)
    assert runner.pool.free_blocks == runner.max_blocks == 8  # nothing leaked


def test_radix_tree_matches_to_the_token_evicts_lru_and_releases_everything(model) -> None:  # type: ignore[no-untyped-def]
    runner = PagedRunner(model, max_seqs=4, max_tokens=4 * 16, block_size=4)
    tree = BlockRadix(runner, max_tokens=4 * 16)
    seq = runner.acquire()
    tokens = list(range(1, 11))  # 2 full blocks + 2 tokens
    runner.prefill(seq, 0, tokens)
    table = runner.tables.table(seq)
    assert tree.insert(tokens, table) == 3 and tree.tokens == 10 and tree.blocks == 3
    runner.release(seq)
    assert runner.pool.used_blocks == 3  # the tree holds them now
    blocks, tail_block, tail = tree.match(tokens + [99], limit=10)
    assert (blocks, tail_block, tail) == (table[:2], table[2], 2)
    assert tree.match(tokens[:6] + [77, 78], limit=8) == (table[:1], table[1], 2)  # 1 full block + 2 tokens of the next
    assert tree.match([5, 5, 5, 5], limit=4) == ([], -1, 0)
    assert tree.match(tokens, limit=5) == (table[:1], table[1], 1)  # never more than the limit
    # a second prefix; then memory pressure: LRU leaves that nothing else holds go first
    other = runner.acquire()
    runner.prefill(other, 0, [50, 51, 52, 53, 54, 55, 56, 57])
    tree.insert([50, 51, 52, 53, 54, 55, 56, 57], runner.tables.table(other))
    tree.match(tokens, limit=10)  # the first prefix is now the most recently used
    assert tree.evictable() == 3  # other's blocks are shared with a running sequence: evicting them frees nothing
    assert tree.evict(1) == 1 and tree.match(tokens, limit=10)[2] == 0  # the first prefix's tail leaf went
    runner.release(other)
    assert tree.evictable() == 4
    assert tree.clear() == 8 + 8 and runner.pool.free_blocks == runner.max_blocks  # nothing leaked


def test_the_trees_own_bound_evicts_and_feeds_the_int8_tier(model) -> None:  # type: ignore[no-untyped-def]
    runner = PagedRunner(model, max_seqs=2, max_tokens=4 * 16, block_size=4)
    evicted: list[tuple[list[int], list[int]]] = []
    tree = BlockRadix(runner, max_tokens=8, on_evict=lambda t, b: evicted.append((t, b)))  # 2 blocks at most
    seq = runner.acquire()
    runner.prefill(seq, 0, list(range(12)))
    table = runner.tables.table(seq)
    tree.insert(list(range(12)), table)
    assert tree.blocks == 2 and evicted == [(list(range(12)), table)]  # the deepest leaf, with its whole prefix
    runner.release(seq)
    tree.clear()
    assert runner.pool.free_blocks == runner.max_blocks


# ------------------------------------------------------------------------ in the engine


@pytest.mark.anyio
async def test_requests_queue_for_blocks_and_produce_what_a_large_pool_produces(model, tok) -> None:  # type: ignore[no-untyped-def]
    prompts = [tok.encode(f"# job {i}: add {i} and {i + 1}\n$ ") for i in range(6)]
    outputs = {}
    for pool in (4096, 64):  # 64 tokens: one request's worst case (about 30 tokens) at a time, then two
        engine = LocalEngine(model, tok, max_batch=6, chunk_size=8, kv_cache_tokens=pool, kv_block_size=4)
        await engine.start()
        try:
            seqs = [engine.submit(p, GREEDY) for p in prompts]
            waited = await _most(engine, seqs, "kv_waiting_for_blocks")
            outputs[pool] = [s.output_ids for s in seqs]
            assert all(s.finish_reason == {"type": "length", "length": 10} for s in seqs)
            stats = engine.statistics()
            assert stats.kv_blocks_total == pool // 4
            assert engine.flush_cache() and engine.statistics().kv_blocks_used == 0  # every block came back
        finally:
            await engine.aclose()
        assert (waited > 0) == (pool == 64)
    assert outputs[64] == outputs[4096]


@pytest.mark.anyio
async def test_a_request_that_can_never_fit_is_refused(model, tok) -> None:  # type: ignore[no-untyped-def]
    engine = LocalEngine(model, tok, kv_cache_tokens=64, kv_block_size=16)
    with pytest.raises(BadRequest, match=r"--kv-cache-tokens.*lower max_new_tokens"):
        engine.submit(tok.encode("hello"), SamplingParams(max_new_tokens=100))
    await engine.aclose()


@pytest.mark.anyio
async def test_a_group_shares_its_prompt_blocks(model, tok) -> None:  # type: ignore[no-untyped-def]
    prompt = tok.encode("# goal: create a.txt containing hi, then list the directory\n$ ")
    engine = LocalEngine(model, tok, max_batch=8, chunk_size=512, kv_block_size=4)
    await engine.start()
    try:
        params = [SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True, sampling_seed=i) for i in range(8)]
        group = [engine.submit(prompt, p) for p in params]
        while not all(s.output_ids for s in group):
            await group[0].wait_changed()
        runner = engine.runner
        assert isinstance(runner, PagedRunner)
        full = (len(prompt) - 1) // 4
        tables = [runner.tables.table(s.kv_id) for s in group if s.kv_id is not None and not s.finished]
        assert len(tables) == 8 and all(t[:full] == tables[0][:full] for t in tables)  # the same pool blocks
        assert all(runner.pool.refcount(b) >= 8 for b in tables[0][:full])
        await asyncio.gather(*(_finish(s) for s in group))
    finally:
        await engine.aclose()


@pytest.mark.anyio
async def test_a_group_is_admitted_on_the_blocks_its_samples_share(model, tok) -> None:  # type: ignore[no-untyped-def]
    """A pool that holds two samples' worst cases but the whole group's shared one: once the first sample
    has computed the prompt, the other seven are admitted on sharing its blocks (each counts only what it
    adds) and run together; the outputs are those of a pool large enough for all eight worst cases."""
    prompt = tok.encode("# goal: write the numbers 1 to 9 into n.txt, one a line, then sort\n$ ")
    worst = -(-(len(prompt) + 10) // 4)  # blocks of one sample's worst case (block size 4)
    pool = 4 * (worst + 7 * (worst - (len(prompt) - 1) // 4) + 4)
    assert 2 * worst * 4 <= pool < 3 * worst * 4  # two samples' worst cases fit, three do not
    outputs = {}
    for tokens in (8 * 4 * worst, pool):
        engine = LocalEngine(model, tok, max_batch=8, chunk_size=512, kv_cache_tokens=tokens, kv_block_size=4)
        await engine.start()
        try:
            group = [engine.submit(prompt, GREEDY) for _ in range(8)]
            assert await _most(engine, group, "running") == 8
            assert engine.statistics().kv_blocks_used <= tokens // 4
            outputs[tokens] = [s.output_ids for s in group]
            assert engine.flush_cache() and engine.statistics().kv_blocks_used == 0  # every block came back
        finally:
            await engine.aclose()
    assert outputs[pool] == outputs[8 * 4 * worst]


@pytest.mark.parametrize("consecutive", [True, False])
def test_cascade_decode_over_a_shared_prefix_matches_the_full_forward(model, tok, consecutive: bool) -> None:  # type: ignore[no-untyped-def]
    """Rows sharing prompt blocks attend to them together (one read) and to their own keys after: same logits."""
    runner = PagedRunner(model, max_seqs=6, max_tokens=4 * 256, block_size=4)
    runner.CASCADE_MIN_TOKENS = 8
    prompt = tok.encode("# a shared prompt, long enough for a few blocks: sum 1..9\n$ ")
    spare = runner.acquire()
    first = runner.acquire()
    if not consecutive:  # interleave the prompt's blocks with another sequence's: the shared keys are gathered
        for i in range(0, len(prompt), 4):
            runner.prefill(first, i, prompt[i:i + 4])
            runner.prefill(spare, i, prompt[i:i + 4])
    else:
        runner.prefill(first, 0, prompt)
    rows = [first] + [runner.acquire() for _ in range(3)]
    for r in rows[1:]:
        runner.copy_prefix(r, first, len(prompt) - 1)
    seqs = [list(prompt[:-1]) for _ in rows]
    toks = [prompt[-1]] * len(rows)
    # row 0 computed its last prompt token already: it decodes the same token again at its own position
    logits = None
    for step in range(3):
        for s, t in zip(seqs, toks):
            s.append(t)
        assert len(runner._cascade_groups([runner.tables.table(r) for r in rows])) == 1
        logits = runner.decode(rows, [len(s) - 1 for s in seqs], toks)
        toks = [int(torch.argmax(row)) if i % 2 == 0 else (7 + i + step) for i, row in enumerate(logits)]
    assert logits is not None
    with torch.no_grad():
        for s, got in zip(seqs, logits):
            want = model(input_ids=torch.tensor([s])).logits[0, -1]
            assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("window", [None, 16])
def test_a_cascade_group_beside_a_shorter_row(model, tok, window: int | None) -> None:  # type: ignore[no-untyped-def]
    """Decode rows of a group sharing prompt blocks next to a shorter, ungrouped row (a lone sample left of
    another group): the step runs (the short row's keys were gathered to its own width, not the batch's: an
    IndexError failed the step) and the group's logits are the ones it gets without the short row; with a
    sliding window the cascade (which reads shared keys unmasked) is not used, so the window holds."""
    prompt = tok.encode("# a shared prompt, long enough for a few blocks: sum 1..9\n$ ")
    out = []
    for with_short in (True, False):
        runner = PagedRunner(model, max_seqs=6, max_tokens=4 * 256, block_size=4, attention_window=window)
        runner.CASCADE_MIN_TOKENS = 8
        first = runner.acquire()
        runner.prefill(first, 0, prompt[:-1])
        rows = [first] + [runner.acquire() for _ in range(2)]
        for r in rows[1:]:
            runner.copy_prefix(r, first, len(prompt) - 1)
        positions, toks = [len(prompt) - 1] * 3, [prompt[-1]] * 3
        if with_short:
            short = runner.acquire()
            runner.prefill(short, 0, prompt[:3])
            rows, positions, toks = rows + [short], positions + [3], toks + [prompt[3]]
        out.append(runner.decode(rows, positions, toks)[:3])
    assert torch.allclose(out[0], out[1], atol=1e-4)
    if window is None:
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        assert all(torch.allclose(row, want, atol=1e-4) for row in out[0])


@pytest.mark.anyio
async def test_a_short_request_beside_a_long_group_in_the_engine(model, tok) -> None:  # type: ignore[no-untyped-def]
    """A one-token request (as /health_generate sends) while a group decodes on a prompt long enough for the
    cascade: every sequence finishes normally, the group's greedy outputs those it has alone."""
    prompt = tok.encode("# a long shared task prompt: read the numbers in n.txt, sum them, print the total\n$ ")
    assert len(prompt) > PagedRunner.CASCADE_MIN_TOKENS + 8
    outputs = []
    for short in (True, False):
        engine = LocalEngine(model, tok, max_batch=8, chunk_size=512, kv_block_size=4)
        await engine.start()
        try:
            group = [engine.submit(prompt, GREEDY) for _ in range(4)]
            while not all(s.output_ids for s in group):  # the group decodes
                await group[0].wait_changed()
            extra = [engine.submit(tok.encode("$"), GREEDY)] if short else []
            done = await asyncio.gather(*(_finish(s) for s in group + extra))
        finally:
            await engine.aclose()
        assert all(s.finish_reason == {"type": "length", "length": 10} for s in done), [s.finish_reason for s in done]
        outputs.append([s.output_ids for s in group])
    assert outputs[0] == outputs[1]


async def _serve_plan(model, tok, kind: str, plan: list[tuple[int, list[int], int]], **kw) -> list[tuple[list[int], str]]:  # type: ignore[no-untyped-def]
    """Submit ``plan``'s requests (each after ``delay`` more tokens of the running ones); greedy outputs."""
    engine = LocalEngine(model, tok, kv_cache=kind, max_batch=8, kv_block_size=4, **kw)
    await engine.start()
    try:
        seqs: list[Sequence] = []
        for delay, prompt, new_tokens in plan:
            for _ in range(delay):
                if any(not s.finished for s in seqs):
                    await next(s for s in seqs if not s.finished).wait_changed()
            seqs.append(engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)))
        return [(s.output_ids, s.finish_reason["type"]) for s in await asyncio.gather(*(_finish(s) for s in seqs))]
    finally:
        await engine.aclose()


@pytest.mark.anyio
async def test_the_paged_and_slot_stores_agree_on_random_workloads(model, tok) -> None:  # type: ignore[no-untyped-def]
    """Differential check, seeded: requests sharing prefixes of 5-150 tokens (groups, cascade-length prompts, short
    rows beside them), arriving mid-generation, chunked prefill, small pools that queue, sliding windows with and
    without sinks: the paged store's greedy outputs are the slot store's (which shares, caches and cascades nothing)."""
    import random

    for seed in range(24):
        rng = random.Random(seed)
        bases = ["".join(rng.choice("abcdefghij klmnop\n$#") for _ in range(rng.choice([5, 40, 90, 150])))
                 for _ in range(3)]
        plan = [(rng.choice([0, 0, 1, 3]), tok.encode(rng.choice(bases) + "xyz"[: rng.randint(0, 3)]),
                 rng.choice([1, 5, 12, 20])) for _ in range(rng.randint(3, 12))]
        window = rng.choice([None, None, 16, 40])
        kw = dict(chunk_size=rng.choice([512, 16, 7]), attention_window=window,
                  attention_sinks=rng.choice([0, 4]) if window else 0)
        paged = await _serve_plan(model, tok, "paged", plan, kv_cache_tokens=rng.choice([4096, 512]), **kw)
        slot = await _serve_plan(model, tok, "slot", plan, **kw)
        assert paged == slot, (seed, kw)
        assert all(reason == "length" for _, reason in paged), seed


@pytest.mark.anyio
async def test_a_sliding_window_releases_the_blocks_no_query_reads(model, tok) -> None:  # type: ignore[no-untyped-def]
    """With a window the paged store gives back a sequence's blocks older than every later query's window (the
    sinks' kept): KV per sequence stays bounded by the window, a pool far smaller than the context serves it,
    a group still shares the prompt, and the greedy outputs are the slot store's (which keeps everything)."""
    prompt = tok.encode("# a long task: " + "read the numbers in n.txt and add them up; " * 3 + "\n$ ")
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    window = dict(attention_window=16, attention_sinks=4, chunk_size=8)
    assert len(prompt) + 40 > 64 + 16 * 4  # the whole context would not fit the pool below
    paged = LocalEngine(model, tok, max_batch=4, kv_block_size=4, kv_cache_tokens=64 + 16 * 4, **window)
    slot = LocalEngine(model, tok, max_batch=4, kv_cache="slot", **window)
    outputs = []
    for engine in (paged, slot):
        await engine.start()
        try:
            group = [engine.submit(prompt, params) for _ in range(3)]
            peak = await _most(engine, group, "kv_blocks_used")
            outputs.append([s.output_ids for s in group])
            if engine is paged:
                # 3 sequences x (sinks' block + window and chunk + margins), far below 3 x the context
                bound = 1 + -(-(16 + 8) // 4) + 3
                assert 0 < peak <= 3 * bound < 3 * (len(prompt) + 40) // 4
                assert [s.cached_tokens > 0 for s in group].count(True) >= 2  # the others shared the prompt
                assert engine.flush_cache() and engine.statistics().kv_blocks_used == 0  # nothing leaked
        finally:
            await engine.aclose()
    assert outputs[0] == outputs[1]
