"""Long-context load test of the local engine: shared prefixes, decode at long contexts, KV budget, sparse attention.

Every ratio is measured against a baseline run in this same script, on the same model:

1. ``group_prefill_ratio`` / ``group_ttft_speedup``: a GRPO group of 8 samples of one long-document
   prompt (~2,000 tokens; ~1,000 with ``--quick``) through the engine with prefix sharing and without
   (``LocalEngine(prefix_sharing=False)``: every sample computes the whole prompt). Prefill tokens
   computed with over without (goal <= 1.2/8), and the group's time to first token (all 8 samples
   have a token) without over with. ``repeat_group_prefill_tokens``: the same group sent again after
   the first finished: what the retained prefix cache leaves to compute.
   ``group_admission_speedup``: 2 (full: 4) such groups, one prompt each, through a pool that holds only
   3 samples' worst cases: admission that credits a sample the prompt blocks it shares with its group
   over admission that counts each at its whole worst case; the most sequences running at once, and
   whether the greedy outputs are identical.
2. ``paged_decode_speedup``: decode throughput of N concurrent sequences (a group's samples) of L context
   tokens through the engine's paged store (one batched step; the shared prompt's blocks attended once
   per step for the group) against the naive per-sequence baseline:
   ``transformers`` with its own contiguous ``past_key_values`` per sequence, decoded one sequence at a
   time as ``generate`` does. Same model, dtype and contexts. ``paged_over_slot``: against the slot store.
   KV bytes per sequence of all three reported.
3. ``max_context_tokens_tiered``: a 16 GiB KV budget over the KV bytes per token in the serving dtype
   (without a tier), and over the int8 tier's bytes per token MEASURED on the engine's prefix cache
   (``--prefix-cache-int8-tokens``: prompts pushed out of a one-prompt hot tier into the int8 tier; the
   count of tokens is computed from those bytes, 16 GiB is not allocated). ``int8_tier``: the same
   prompts sent again are served from the int8 tier: hit tokens, and ``int8_output_agreement`` (greedy
   completions identical to the first, computed ones) with the largest logprob difference.
   ``disk_ttft_speedup``: the first of those prompts pushed down hot -> int8 -> disk
   (``--prefix-cache-disk-tokens``) by the others and sent again: time to first token restored from the
   disk tier against computed by an engine that retains nothing.
4. ``sparse_accuracy_delta``: held-out ``longdoc`` tasks (greedy, the chat template) with a sliding
   window + attention sinks minus with full attention, ``sparse_speed_ratio`` (seconds full over
   seconds windowed, the same tasks), ``sparse_output_agreement`` (the fraction of tasks whose greedy
   completion the window leaves unchanged) and ``answer_logprob_delta`` (the mean log-probability per token
   of the right ``Answer: ...`` line, teacher-forced, windowed minus full): signals even where the model
   scores 0 either way. The full run uses documents of ~7,500 tokens (8k context with the chat template).
   ``sparse_kv_ratio``: the most KV one sequence held between steps (a step adds at most one prefill
   chunk), windowed over full attention (the paged store releases the blocks no later query of a
   windowed sequence reads).

    python -m loadtests.long_context --quick --json runs/long_context.json
    python -m loadtests.long_context --parts sparse --sparse-tasks 2 --json runs/sparse-8k.json  # one part

The model is SmolLM2-135M-Instruct from ~/.cache/rollout-engine/models (``--model-dir``); when it is
absent the tiny char-model fixture stands in and the output says so (``model_kind``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = Path.home() / ".cache/rollout-engine/models/smollm2-135m-instruct"
GROUP = 8
BUDGET_BYTES = 16 * 1024**3
CHUNK = 512
PARTS = ("group", "decode", "tiers", "sparse")


def _load(model_dir: Path | None, tmp: str) -> tuple[Any, Any, str]:
    from modelserver.llm import load_model_dir, write_tiny_model_dir

    if model_dir is not None and (model_dir / "config.json").is_file():
        model, tok = load_model_dir(model_dir)
        return model, tok, f"real: {model_dir.name}"
    path = write_tiny_model_dir(tmp, seed=0, max_position_embeddings=16384)
    model, tok = load_model_dir(path)
    return model, tok, f"tiny char fixture (real model absent at {model_dir})"


def _chat_ids(tok: Any, prompt: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        return list(tok(text, add_special_tokens=False).input_ids)
    return list(tok.encode(prompt))


def _engine(model: Any, tok: Any, dtype: str, **kw: Any) -> Any:
    from modelserver.local.engine import LocalEngine

    return LocalEngine(model, tok, **{"max_batch": GROUP, "chunk_size": CHUNK, "dtype": dtype, **kw})


# ------------------------------------------------------------------------ 1. a group on one prompt


async def _complete(engine: Any, prompt: list[int], params: Any) -> tuple[Any, float]:
    """Run one request to its end: the sequence, and seconds until its first output token."""
    t0, ttft = time.monotonic(), 0.0
    seq = engine.submit(prompt, params)
    while not seq.finished:
        await seq.wait_changed()
        if seq.output_ids and not ttft:
            ttft = time.monotonic() - t0
    return seq, ttft


async def _group(engine: Any, prompt: list[int]) -> float:
    """Submit a group of 8 samples; seconds until every one has its first token (they then finish)."""
    from modelserver.local.protocol import SamplingParams

    t0 = time.monotonic()
    seqs = [engine.submit(prompt, SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True, sampling_seed=i))
            for i in range(GROUP)]
    ttft = 0.0
    for seq in seqs:
        while not seq.output_ids and not seq.finished:
            await seq.wait_changed()
        ttft = max(ttft, time.monotonic() - t0)
    for seq in seqs:
        while not seq.finished:
            await seq.wait_changed()
    return ttft


async def measure_group(model: Any, tok: Any, dtype: str, prompt: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"group": GROUP, "prompt_tokens": len(prompt)}
    for sharing in (False, True):
        engine = _engine(model, tok, dtype, prefix_sharing=sharing)
        await engine.start()
        try:
            ttft = await _group(engine, prompt)
            computed = engine.statistics().prefill_tokens
            key = "shared" if sharing else "unshared"
            out[f"ttft_s_{key}"] = round(ttft, 3)
            out[f"prefill_tokens_{key}"] = computed
            if sharing:  # the same group again: served from the retained prefix cache
                await _group(engine, prompt)
                stats = engine.statistics()
                out["repeat_group_prefill_tokens"] = stats.prefill_tokens - computed
                out["prefix_cache_hits"] = stats.prefix_cache_hits
        finally:
            await engine.aclose()
    out["group_prefill_ratio"] = out["prefill_tokens_shared"] / out["prefill_tokens_unshared"]
    out["group_ttft_speedup"] = out["ttft_s_unshared"] / out["ttft_s_shared"]
    return out


async def measure_group_admission(model: Any, tok: Any, dtype: str, prompts: list[list[int]],
                                  new_tokens: int = 16) -> dict[str, Any]:
    """Groups of 8 samples (one distinct prompt each) through a pool that holds 3 samples' worst cases:
    admitted on the prompt blocks a group's samples share against each counted at its whole worst case
    (``LocalEngine.admission_credit``). Seconds until every sample finished, and the most running at once."""
    from modelserver.local.protocol import SamplingParams

    block = 16
    worst = max(-(-(len(p) + new_tokens) // block) for p in prompts)
    out: dict[str, Any] = {"groups": len(prompts), "group": GROUP, "prompt_tokens": [len(p) for p in prompts],
                           "new_tokens": new_tokens, "pool_tokens": 3 * worst * block}
    outputs = {}
    for credit in (False, True):
        engine = _engine(model, tok, dtype, max_batch=GROUP * len(prompts), kv_cache_tokens=3 * worst * block,
                         kv_block_size=block)
        engine.admission_credit = credit
        await engine.start()
        try:
            t0 = time.monotonic()
            seqs = [engine.submit(p, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
                    for p in prompts for _ in range(GROUP)]
            running = 0
            while not all(s.finished for s in seqs):
                running = max(running, engine.statistics().running)
                await next(s for s in seqs if not s.finished).wait_changed()
            key = "credit" if credit else "no_credit"
            out[f"seconds_{key}"] = round(time.monotonic() - t0, 3)
            out[f"max_running_{key}"] = running
            outputs[credit] = [s.output_ids for s in seqs]
        finally:
            await engine.aclose()
    out["group_admission_speedup"] = out["seconds_no_credit"] / out["seconds_credit"]
    out["outputs_identical"] = outputs[True] == outputs[False]
    return out


# ------------------------------------------------------------------------ 2. decode at long contexts


@torch.inference_mode()
def measure_decode(model: Any, n_seqs: int, context: int, steps: int) -> dict[str, Any]:
    """Decode tokens/s of ``n_seqs`` sequences of ``context`` tokens: the paged store, the slot store, per-sequence HF.

    The sequences are a group's samples: one prompt prefilled once, shared by every row (the paged store
    shares its blocks and attends to them once per step for the whole group; the slot store copies them into
    every row; HF holds a contiguous copy per sequence).
    """
    from transformers import DynamicCache

    from modelserver.local.runner import PagedRunner, SlotRunner

    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(10, vocab - 10, (context,), generator=gen).tolist()
    runners: dict[str, Any] = {
        "paged": PagedRunner(model, max_seqs=n_seqs, max_tokens=context + n_seqs * (steps + 64)),
        "slot": SlotRunner(model, max_slots=n_seqs),
    }
    slots: dict[str, list[int]] = {}
    for name, runner in runners.items():
        # one prefill, shared with every row (contents do not change decode cost), then batched steps
        slots[name] = rows = [runner.acquire() for _ in range(n_seqs)]
        for i in range(0, context, CHUNK):
            runner.step([(rows[0], i, ids[i:i + CHUNK])], [], [], [])
        for s in rows[1:]:
            runner.copy_prefix(s, rows[0], context)
        runner.step([], rows, [context] * n_seqs, [ids[-1]] * n_seqs)  # warm-up step (allocations)
    # baseline: a contiguous HF cache per sequence, decoded one sequence at a time
    base = DynamicCache()
    model(input_ids=torch.tensor([ids[:-1]]), cache=base, use_cache=True)
    caches = [copy.deepcopy(base) for _ in range(n_seqs)]
    for c in caches:  # warm-up step
        model(input_ids=torch.tensor([[ids[-1]]]), cache=c, use_cache=True)
    # interleaved, step by step: a shared machine's load changes over seconds and must hit all alike
    seconds = {"paged": 0.0, "slot": 0.0, "hf": 0.0}
    for k in range(steps):
        for name, runner in runners.items():
            t0 = time.monotonic()
            logits = runner.step([], slots[name], [context + 1 + k] * n_seqs, [ids[k]] * n_seqs)[1]
            assert logits is not None
            seconds[name] += time.monotonic() - t0
        t0 = time.monotonic()
        for c in caches:
            model(input_ids=torch.tensor([[ids[k]]]), cache=c, use_cache=True)
        seconds["hf"] += time.monotonic() - t0
    paged: Any = runners["paged"]
    per_token = paged.bytes_per_token()
    tokens = n_seqs * steps
    rate = {name: tokens / s for name, s in seconds.items()}
    return {
        "sequences": n_seqs, "context": context, "steps": steps,
        "engine_tokens_per_s": round(rate["paged"], 1), "slot_tokens_per_s": round(rate["slot"], 1),
        "hf_tokens_per_s": round(rate["hf"], 1),
        "paged_decode_speedup": rate["paged"] / rate["hf"],
        "paged_over_slot": rate["paged"] / rate["slot"],
        "kv_bytes_per_seq_engine": paged.pool.used_blocks * paged.block_size * per_token // n_seqs,
        "kv_bytes_per_seq_slot": runners["slot"].cache_bytes() // n_seqs,
        "kv_bytes_per_seq_hf": per_token * (context + steps + 1),
        "note": "engine = the paged store (blocks in use x block size, the shared prompt's blocks counted once); "
                "slot = a preallocated row per sequence (capacity doubling); baseline = HF past_key_values per "
                "sequence (the naive contiguous cache), sequences decoded one after another",
    }


# ------------------------------------------------------------------------ 3. KV budget (computed)


def kv_budget(model: Any) -> dict[str, Any]:
    cfg = model.config
    layers, kv_heads = int(cfg.num_hidden_layers), int(cfg.num_key_value_heads)
    head_dim = int(getattr(cfg, "head_dim", 0) or cfg.hidden_size // cfg.num_attention_heads)
    elements = 2 * layers * kv_heads * head_dim
    per_token = {"fp32": elements * 4, "bf16": elements * 2, "int8": elements + 2 * layers * kv_heads * 4}
    return {
        "computed": True,
        "note": "computed from bytes/token against a 16 GiB KV budget (int8: the formula; the measured figure is "
                "max_context_tokens_int8_tier_measured)",
        "kv_bytes_per_token": per_token,
        "max_context_tokens_fp32": BUDGET_BYTES // per_token["fp32"],
        "max_context_tokens_bf16": BUDGET_BYTES // per_token["bf16"],
        "max_context_tokens_int8_tier": BUDGET_BYTES // per_token["int8"],
    }


async def measure_int8_tier(model: Any, tok: Any, dtype: str, prompts: list[list[int]], new_tokens: int = 8) -> dict[str, Any]:
    """Prompts through an engine whose hot prefix tier holds one of them: the rest go down to int8; then again."""
    from modelserver.local.protocol import SamplingParams

    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    hot = max(len(p) for p in prompts) + new_tokens + 1
    engine = _engine(model, tok, dtype, prefix_cache_tokens=hot, prefix_cache_int8_tokens=hot * len(prompts) * 2)
    await engine.start()

    try:
        first = [(await _complete(engine, p, greedy))[0] for p in prompts]
        held = engine.statistics()
        again = [(await _complete(engine, p, greedy))[0] for p in prompts]
        stats = engine.statistics()
    finally:
        await engine.aclose()
    agree = sum(a.output_ids == b.output_ids for a, b in zip(first, again))
    diff = max(max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) for a, b in zip(first, again))
    return {
        "prompts": len(prompts), "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts)),
        "int8_tokens_held": held.prefix_cache_int8_tokens, "int8_bytes_held": held.prefix_cache_int8_bytes,
        "int8_bytes_per_token_measured": round(held.prefix_cache_int8_bytes / max(1, held.prefix_cache_int8_tokens), 1),
        "hot_bytes_per_token": held.kv_bytes_per_token,
        "int8_hits": stats.prefix_cache_int8_hits, "int8_hit_tokens": stats.prefix_cache_int8_hit_tokens,
        "int8_output_agreement": agree / len(prompts), "int8_max_logprob_diff": round(diff, 4),
    }


async def measure_disk_tier(model: Any, tok: Any, dtype: str, prompts: list[list[int]], new_tokens: int = 8
                            ) -> dict[str, Any]:
    """The first prompt pushed down hot -> int8 -> disk by the others, then sent again: its time to first
    token restored from disk against computing it (an engine that retains nothing), greedy agreement."""
    from modelserver.local.protocol import SamplingParams

    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    one = max(len(p) for p in prompts) + new_tokens + 1

    with tempfile.TemporaryDirectory(prefix="kv-disk-") as disk:
        engine = _engine(model, tok, dtype, prefix_cache_tokens=one, prefix_cache_int8_tokens=one,
                         prefix_cache_disk_tokens=one * len(prompts), prefix_cache_disk_dir=disk)
        await engine.start()
        try:
            first = [(await _complete(engine, p, greedy))[0] for p in prompts]
            held = engine.statistics()
            again, ttft_disk = await _complete(engine, prompts[0], greedy)
            stats = engine.statistics()
        finally:
            await engine.aclose()
    cold = _engine(model, tok, dtype, prefix_cache_tokens=0)
    await cold.start()
    try:
        _, ttft_compute = await _complete(cold, prompts[0], greedy)
    finally:
        await cold.aclose()
    return {
        "prompts": len(prompts), "prompt_tokens": len(prompts[0]),
        "disk_tokens_held": held.prefix_cache_disk_tokens, "disk_bytes_held": held.prefix_cache_disk_bytes,
        "disk_hits": stats.prefix_cache_disk_hits, "disk_hit_tokens": stats.prefix_cache_disk_hit_tokens,
        "ttft_s_disk": round(ttft_disk, 4), "ttft_s_compute": round(ttft_compute, 4),
        "disk_ttft_speedup": ttft_compute / ttft_disk if ttft_disk else 0.0,
        "disk_output_agreement": float(again.output_ids == first[0].output_ids),
    }


# ------------------------------------------------------------------------ 4. sparse attention accuracy


async def measure_sparse(model: Any, tok: Any, dtype: str, n: int, tokens: int, window: int,
                         sinks: int) -> dict[str, Any]:
    from domains.longdoc import MAX_NEW_TOKENS, is_correct, longdoc_format, longdoc_tasks
    from modelserver.local.protocol import SamplingParams

    tasks = longdoc_tasks(n, tokens, seed=0)
    prompts = [_chat_ids(tok, prompt) for prompt, _ in tasks]
    completions: dict[str, list[str]] = {}
    out: dict[str, Any] = {"tasks": n, "doc_tokens": tokens, "window": window, "sinks": sinks,
                           "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts))}
    for name, kw in (("full", {}), ("window", {"attention_window": window, "attention_sinks": sinks})):
        engine = _engine(model, tok, dtype, prefix_cache_tokens=0, **kw)
        await engine.start()
        right, texts, peak = 0, [], 0
        t0 = time.monotonic()
        try:
            for prompt, (_, answer) in zip(prompts, tasks):
                seq = engine.submit(prompt, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0))
                while not seq.finished:
                    peak = max(peak, engine.statistics().kv_blocks_used)
                    await seq.wait_changed()
                text = engine.output_text(seq)
                texts.append(text)
                right += is_correct(text, answer)
        finally:
            await engine.aclose()
        out[f"seconds_{name}"] = round(time.monotonic() - t0, 2)
        stats = engine.statistics()
        out[f"kv_bytes_peak_{name}"] = peak * stats.kv_block_size * stats.kv_bytes_per_token  # one sequence at a time
        out[f"accuracy_{name}"] = right / n
        out[f"example_{name}"] = texts[0]
        out[f"strict_format_{name}"] = sum(longdoc_format(t) for t in texts) / n
        completions[name] = texts
        out[f"answer_logprob_{name}"] = _answer_logprob(model, prompts, [f"Answer: {a}" for _, a in tasks], tok, **kw)
    out["sparse_accuracy_delta"] = out["accuracy_window"] - out["accuracy_full"]
    # a continuous accuracy signal: the log-likelihood of the right answer line, teacher-forced
    out["answer_logprob_delta"] = out["answer_logprob_window"] - out["answer_logprob_full"]
    # a signal even where the model scores 0 either way: how often the window changes the greedy answer
    out["sparse_output_agreement"] = sum(a == b for a, b in zip(completions["full"], completions["window"])) / n
    out["sparse_speed_ratio"] = out["seconds_full"] / out["seconds_window"]
    # the window releases the blocks no later query reads: KV held per sequence, windowed over full
    out["sparse_kv_ratio"] = out["kv_bytes_peak_window"] / max(1, out["kv_bytes_peak_full"])
    return out


@torch.inference_mode()
def _answer_logprob(model: Any, prompts: list[list[int]], targets: list[str], tok: Any, **window: Any) -> float:
    """Mean log-probability per token of each task's right answer line after its prompt (teacher-forced)."""
    from modelserver.local.runner import PagedRunner

    total, count = 0.0, 0
    for prompt, target in zip(prompts, targets):
        answer = tok.encode(target, add_special_tokens=False)
        runner = PagedRunner(model, max_seqs=1, max_tokens=len(prompt) + len(answer) + 32, **window)
        seq = runner.acquire()
        logits = None
        for i in range(0, len(prompt), CHUNK):
            logits = runner.prefill(seq, i, prompt[i:i + CHUNK])
        for k, token in enumerate(answer):
            assert logits is not None
            total += float(torch.log_softmax(logits.float(), dim=-1)[token])
            count += 1
            logits = runner.decode([seq], [len(prompt) + k], [token])[0]
    return round(total / max(1, count), 4)


# ------------------------------------------------------------------------ main


def _group_prompt(tok: Any, tokens: int) -> list[int]:
    from domains.longdoc import make_longdoc_tokens

    return _chat_ids(tok, make_longdoc_tokens(random.Random(7), tokens).prompt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller prompts and counts (a few minutes on 2 cores)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="serving dtype (default: bf16)")
    # one thread: on a shared, loaded machine OpenMP threads spin-waiting on each other made every pass
    # 10x slower (measured: 2.7 vs 45.6 decode tokens/s at load average 12 on 2 cores)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which parts to run, comma-separated, of {','.join(PARTS)} (default: all)")
    parser.add_argument("--sparse-tasks", type=int, help="longdoc tasks of the sparse part (default: 3 quick, 8 full)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts: unknown {unknown}, choose from {','.join(PARTS)}" if unknown else "--parts: none given")
    if args.sparse_tasks is not None and args.sparse_tasks < 1:
        parser.error(f"--sparse-tasks must be at least 1, got {args.sparse_tasks}")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.quick:
        group_tokens, decode_n, decode_ctx, decode_steps, sparse_n, sparse_tokens, window = 1000, 8, 1000, 8, 3, 1000, 256
        tier_n, tier_tokens = 3, 500
    else:
        group_tokens, decode_n, decode_ctx, decode_steps, sparse_n, sparse_tokens, window = 2000, 32, 4000, 16, 8, 7500, 1024
        tier_n, tier_tokens = 8, 2000
    sinks = 4
    sparse_n = args.sparse_tasks or sparse_n
    admit_groups, admit_tokens = (2, 1000) if args.quick else (4, 2000)
    t_start = time.monotonic()
    from domains.longdoc import make_longdoc_tokens

    result: dict[str, Any] = {"model_kind": "", "dtype": args.dtype, "quick": args.quick, "simulated": False,
                              "parts": parts}
    details: dict[str, Any] = {}
    rows: list[tuple[str, str, str]] = []

    def done(part: str) -> None:
        print(f"{part} done ({time.monotonic() - t_start:.0f}s)", flush=True)

    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        model, tok, model_kind = _load(args.model_dir, tmp)
        from modelserver.local.engine import SERVING_DTYPES

        model = model.to(SERVING_DTYPES[args.dtype])
        result["model_kind"] = model_kind
        print(f"model: {model_kind}; dtype {args.dtype}; {args.threads} threads; quick={args.quick}; "
              f"parts {','.join(parts)}", flush=True)
        if "group" in parts:
            group = asyncio.run(measure_group(model, tok, args.dtype, _group_prompt(tok, group_tokens)))
            done("group")
            rng = random.Random(13)
            admission = asyncio.run(measure_group_admission(
                model, tok, args.dtype, [_chat_ids(tok, make_longdoc_tokens(rng, admit_tokens).prompt)
                                         for _ in range(admit_groups)]))
            done("group admission")
            result.update(group_prefill_ratio=group["group_prefill_ratio"], group_prefill_goal=1.2 / GROUP,
                          group_ttft_speedup=group["group_ttft_speedup"],
                          group_admission_speedup=admission["group_admission_speedup"])
            details.update(group=group, group_admission=admission)
            rows += _group_rows(group, admission)
        if "decode" in parts:
            decode = measure_decode(model, decode_n, decode_ctx, decode_steps)
            done("decode")
            result["paged_decode_speedup"] = decode["paged_decode_speedup"]
            details["decode"] = decode
            rows += _decode_rows(decode)
        if "tiers" in parts:
            budget = kv_budget(model)
            rng = random.Random(11)
            tier_prompts = [_chat_ids(tok, make_longdoc_tokens(rng, tier_tokens).prompt) for _ in range(tier_n)]
            tier = asyncio.run(measure_int8_tier(model, tok, args.dtype, tier_prompts))
            done("int8 tier")
            budget["max_context_tokens_int8_tier_measured"] = int(BUDGET_BYTES // tier["int8_bytes_per_token_measured"])
            disk = asyncio.run(measure_disk_tier(model, tok, args.dtype, tier_prompts))
            done("disk tier")
            result.update(
                max_context_tokens_tiered={"without_tier": budget[f"max_context_tokens_{args.dtype}"],
                                           "with_int8_tier": budget["max_context_tokens_int8_tier_measured"],
                                           "note": "16 GiB over bytes/token; the int8 tier's bytes/token measured "
                                                   "on the engine's prefix cache"},
                int8_output_agreement=tier["int8_output_agreement"], disk_ttft_speedup=disk["disk_ttft_speedup"])
            details.update(kv_budget=budget, int8_tier=tier, disk_tier=disk)
            rows += _tier_rows(budget, tier, disk, args.dtype)
        if "sparse" in parts:
            sparse = asyncio.run(measure_sparse(model, tok, args.dtype, sparse_n, sparse_tokens, window, sinks))
            done("sparse")
            result.update({k: sparse[k] for k in ("sparse_accuracy_delta", "sparse_speed_ratio", "sparse_kv_ratio",
                                                  "sparse_output_agreement", "answer_logprob_delta")})
            details["sparse"] = sparse
            rows += _sparse_rows(sparse)
    result["details"] = details
    result["seconds"] = round(time.monotonic() - t_start, 1)
    print(f"\nlong context, model {result['model_kind']}, {args.dtype}, {result['seconds']}s")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _group_rows(group: dict[str, Any], admission: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        ("group_prefill_ratio", f"{group['group_prefill_ratio']:.4f}",
         f"{group['prefill_tokens_shared']} / {group['prefill_tokens_unshared']} prefill tokens, "
         f"{GROUP} x {group['prompt_tokens']}-token prompt (goal <= {1.2 / GROUP:.3f})"),
        ("group_ttft_speedup", f"{group['group_ttft_speedup']:.2f}x",
         f"{group['ttft_s_unshared']}s unshared / {group['ttft_s_shared']}s shared"),
        ("repeat_group_prefill_tokens", str(group["repeat_group_prefill_tokens"]),
         f"the same group again: {group['prefix_cache_hits']} prefix-cache hits (last prompt token: a decode row)"),
        ("group_admission_speedup", f"{admission['group_admission_speedup']:.2f}x",
         f"{admission['groups']} groups x {GROUP} in a pool of 3 worst cases ({admission['pool_tokens']} tokens): "
         f"{admission['seconds_no_credit']}s / {admission['seconds_credit']}s, at most "
         f"{admission['max_running_no_credit']} / {admission['max_running_credit']} running "
         f"(each sample at its worst case / credited the blocks it shares)"),
    ]


def _decode_rows(decode: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        ("paged_decode_speedup", f"{decode['paged_decode_speedup']:.2f}x",
         f"{decode['engine_tokens_per_s']} vs {decode['hf_tokens_per_s']} tok/s, {decode['sequences']} seqs x "
         f"{decode['context']} ctx; {decode['paged_over_slot']:.2f}x the slot store ({decode['slot_tokens_per_s']} tok/s); "
         f"KV/seq {decode['kv_bytes_per_seq_engine'] / 2**20:.1f} MiB paged, "
         f"{decode['kv_bytes_per_seq_slot'] / 2**20:.0f} MiB slot, "
         f"{decode['kv_bytes_per_seq_hf'] / 2**20:.0f} MiB HF"),
    ]


def _tier_rows(budget: dict[str, Any], tier: dict[str, Any], disk: dict[str, Any], dtype: str
               ) -> list[tuple[str, str, str]]:
    return [
        ("max_context_tokens", f"{budget[f'max_context_tokens_{dtype}']:,}",
         f"16 GiB / {budget['kv_bytes_per_token'][dtype]} B/token ({dtype}), no tier"),
        ("  with the int8 tier", f"{budget['max_context_tokens_int8_tier_measured']:,}",
         f"16 GiB / {tier['int8_bytes_per_token_measured']} B/token measured in the int8 tier "
         f"({tier['int8_tokens_held']} tokens held)"),
        ("int8_output_agreement", f"{tier['int8_output_agreement']:.3f}",
         f"{tier['prompts']} prompts of ~{tier['prompt_tokens_mean']} tokens served again from int8 "
         f"({tier['int8_hit_tokens']} hit tokens); max logprob diff {tier['int8_max_logprob_diff']}"),
        ("disk_ttft_speedup", f"{disk['disk_ttft_speedup']:.2f}x",
         f"a {disk['prompt_tokens']}-token prompt pushed down to the disk tier and sent again: first token in "
         f"{disk['ttft_s_disk']}s from disk vs {disk['ttft_s_compute']}s computed; {disk['disk_hits']} disk hit(s), "
         f"greedy agreement {disk['disk_output_agreement']:.0f}"),
    ]


def _sparse_rows(sparse: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        ("sparse_accuracy_delta", f"{sparse['sparse_accuracy_delta']:+.3f}",
         f"window {sparse['window']}+{sparse['sinks']} sinks {sparse['accuracy_window']:.3f} vs full "
         f"{sparse['accuracy_full']:.3f}, {sparse['tasks']} longdoc tasks of ~{sparse['prompt_tokens_mean']} tokens; "
         f"strict format {sparse['strict_format_window']:.2f} vs {sparse['strict_format_full']:.2f}"),
        ("sparse_output_agreement", f"{sparse['sparse_output_agreement']:.3f}",
         "fraction of tasks whose greedy completion is identical with the window and without"),
        ("answer_logprob_delta", f"{sparse['answer_logprob_delta']:+.3f}",
         f"nats/token of the right 'Answer: ...' line, teacher-forced: window {sparse['answer_logprob_window']} vs "
         f"full {sparse['answer_logprob_full']}"),
        ("sparse_speed_ratio", f"{sparse['sparse_speed_ratio']:.2f}x",
         f"{sparse['seconds_full']}s full / {sparse['seconds_window']}s windowed"),
        ("sparse_kv_ratio", f"{sparse['sparse_kv_ratio']:.3f}",
         f"most KV a sequence held between steps, windowed / full: {sparse['kv_bytes_peak_window'] / 2**20:.1f} / "
         f"{sparse['kv_bytes_peak_full'] / 2**20:.1f} MiB (the window's older blocks are released as it moves)"),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
