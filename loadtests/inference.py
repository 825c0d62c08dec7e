"""Load test of the local inference engine: batching throughput and chunked-prefill memory.

1. Throughput: output tokens/s of the in-process engine with 1, 8 and 32 concurrent request streams
   (each stream issues its requests back to back), compared with one request at a time (c1).
2. Prefill memory: peak RSS growth of prefilling one prompt of 1k..32k tokens with chunked prefill
   (chunks of 512 against the growing KV cache) vs a single full-length pass through the same runner.
   Each measurement runs in a fresh subprocess (RSS high-water mark is per process) under an
   address-space limit, so a full pass that would exhaust the machine is reported as failing, not fatal.

    python -m loadtests.inference [--quick] [--json PATH]

3. With ``--model-dir DIR`` (a real model, e.g. SmolLM2-135M-Instruct): 32 chat requests of 16-64 new
   tokens (``--quick`` too) through the engine against ``transformers`` ``generate`` on one left-padded batch
   of the same requests, same model, same process, same sampling (T=1, no truncation), like for like: fp32
   on both sides, then bf16 on both sides; repeats interleave the two sides. ``hf_generate_ratio``
   (generate's median seconds over the engine's, for the same useful tokens, fp32/fp32) and
   ``hf_generate_ratio_bf16``.

Headline keys: hf_generate_ratio, hf_generate_ratio_bf16, tokens_per_s_c1, tokens_per_s_c8, tokens_per_s_c32, concurrency_speedup_c32,
prefill_peak_mb_chunked_<n>, prefill_peak_mb_full_<n> (null when the full pass exceeded the limit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

CHUNK = 512
MEMORY_LIMIT_GB = 16  # child address-space cap: leaves room on a 24 GiB machine


def _engine_and_tokenizer(max_batch: int):  # type: ignore[no-untyped-def]
    from modelserver.local.engine import LocalEngine
    from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config

    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tok)), seed=0)
    return LocalEngine(model, tok, max_batch=max_batch, chunk_size=CHUNK), tok


async def _throughput(concurrency: int, requests_per_stream: int, new_tokens: int) -> float:
    from modelserver.local.protocol import SamplingParams

    engine, tok = _engine_and_tokenizer(max_batch=max(concurrency, 1))
    await engine.start()
    prompt = tok.encode("def solve(xs):\n    return sorted(xs)[::-1]  # ")

    async def stream(i: int) -> int:
        produced = 0
        for j in range(requests_per_stream):
            params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=i * 1000 + j)
            seq = engine.submit(prompt, params)
            while not seq.finished:
                await seq.wait_changed()
            produced += len(seq.output_ids)
        return produced

    try:
        await stream(-1)  # warm-up
        start = time.perf_counter()
        total = sum(await asyncio.gather(*(stream(i) for i in range(concurrency))))
        return total / (time.perf_counter() - start)
    finally:
        await engine.aclose()


def _prefill_child(mode: str, length: int) -> None:
    """Child process: print the peak RSS growth (MB) of one prefill of ``length`` tokens."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_GB << 30, MEMORY_LIMIT_GB << 30))
    import torch

    from modelserver.local.runner import SlotRunner
    from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config

    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tok), max_position_embeddings=65536), seed=0)
    runner = SlotRunner(model, max_slots=1, initial_capacity=length)
    ids = torch.randint(4, len(tok), (length,), generator=torch.Generator().manual_seed(0)).tolist()
    slot = runner.acquire()
    runner.prefill(slot, 0, ids[:CHUNK])  # warm-up at the chunk size (the cache is allocated here)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        if mode == "chunked":
            for i in range(0, length, CHUNK):
                runner.prefill(slot, i, ids[i : i + CHUNK], logits=i + CHUNK >= length)
        else:
            runner.prefill(slot, 0, ids)
    except (RuntimeError, MemoryError) as exc:
        print(json.dumps({"peak_mb": None, "seconds": time.perf_counter() - start, "error": str(exc)[:200]}))
        return
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": (after - before) / 1024, "seconds": time.perf_counter() - start}))


REAL_QUESTIONS = (
    "What is 7 + 5?", "Name three colours.", "Write a haiku about the sea.", "What is the capital of France?",
    "Explain what a list is in Python.", "Give me a synonym of happy.", "How many legs does a spider have?",
    "Translate 'good morning' to French.",
)


def _real_requests(tok, n: int) -> list[tuple[list[int], int]]:  # type: ignore[no-untyped-def]
    """``n`` chat-templated prompts with 16..64 new tokens each (deterministic)."""
    from modelserver.llm import render_prompt

    out = []
    for i in range(n):
        question = f"{REAL_QUESTIONS[i % len(REAL_QUESTIONS)]} (request {i})"
        out.append((render_prompt(tok, question), 16 + (48 * i) // max(1, n - 1)))
    return out


async def _engine_real(model, tok, requests: list[tuple[list[int], int]], dtype: str = "fp32",  # type: ignore[no-untyped-def]
                       model_thread=None) -> float:
    from modelserver.local.engine import LocalEngine
    from modelserver.local.protocol import SamplingParams

    engine = LocalEngine(model, tok, max_batch=len(requests), chunk_size=CHUNK, dtype=dtype, model_thread=model_thread)
    await engine.start()
    try:
        warm = engine.submit(requests[0][0], SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True))
        while not warm.finished:
            await warm.wait_changed()
        start = time.perf_counter()
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=i))
                for i, (p, n) in enumerate(requests)]
        for seq in seqs:
            while not seq.finished:
                await seq.wait_changed()
        return time.perf_counter() - start
    finally:
        await engine.aclose()


def _hf_generate_real(model, tok, requests: list[tuple[list[int], int]]) -> float:  # type: ignore[no-untyped-def]
    """What a user writes with transformers alone: one left-padded batch, ``generate`` to the longest request."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p, _ in requests)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in requests])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in requests])
    longest = max(n for _, n in requests)
    with torch.inference_mode():
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=True, pad_token_id=pad)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad)
    return time.perf_counter() - start


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def real_model(model_dir: Path, n: int, threads: int, repeats: int = 2) -> dict[str, object]:
    """The local engine against ``transformers`` ``generate`` on the same requests, like for like: fp32 on
    both sides, then bf16 on both sides (a second row).

    The repeats interleave the two sides (engine first in even repeats, generate first in odd ones) so a
    load change on a shared machine hits both; the ratio is of the two sides' median seconds. Headline keys:
    ``hf_generate_ratio`` (fp32 / fp32) and ``hf_generate_ratio_bf16`` (bf16 / bf16).

    Both sides' torch work (loading, ``generate``, the engine's steps) runs on one model thread with
    ``threads`` intra-op threads, as in a server process: a second thread's OpenMP team would throttle
    whichever side ran on the other (``modelserver/local/model_thread.py``).
    """
    import copy
    import os

    import torch

    from modelserver.llm import load_model_dir
    from modelserver.local.model_thread import ModelThread

    model_thread = ModelThread(threads)
    model, tok = model_thread.call(load_model_dir, model_dir)
    models = {"fp32": model, "bf16": model_thread.call(lambda: torch.nn.Module.to(copy.deepcopy(model), torch.bfloat16))}
    requests = _real_requests(tok, n)
    useful = sum(k for _, k in requests)
    figures: dict[str, Any] = {"real_requests": n, "real_useful_tokens": useful, "real_threads": threads,
                               "real_repeats": repeats}
    loads: list[float] = []
    print(f"{'real model':<10} {'engine s':>9} {'generate s':>11} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>6}"
          f"   ({n} chat requests, {useful} new tokens, 16..64 each, {threads} threads, {repeats} repeats)")
    for dtype, served in models.items():
        engine_runs: list[float] = []
        hf_runs: list[float] = []
        for rep in range(repeats):
            loads.append(os.getloadavg()[0])
            # the engine casts in place to its serving dtype: here the model is in that dtype already
            sides = [lambda: engine_runs.append(asyncio.run(_engine_real(served, tok, requests, dtype, model_thread))),
                     lambda: hf_runs.append(model_thread.call(_hf_generate_real, served, tok, requests))]
            for side in sides if rep % 2 == 0 else sides[::-1]:
                side()
        engine_s, hf_s = _median(engine_runs), _median(hf_runs)
        ratio = round(hf_s / engine_s, 2)
        suffix = "" if dtype == "fp32" else "_bf16"
        figures.update({f"real_engine_s{suffix}": round(engine_s, 2), f"real_hf_generate_s{suffix}": round(hf_s, 2),
                        f"real_engine_tokens_per_s{suffix}": round(useful / engine_s, 1),
                        f"real_hf_generate_tokens_per_s{suffix}": round(useful / hf_s, 1),
                        f"hf_generate_ratio{suffix}": ratio,
                        f"hf_generate_ratios{suffix}": [round(h / e, 2) for e, h in zip(engine_runs, hf_runs)]})
        print(f"{dtype + '/' + dtype:<10} {engine_s:>9.1f} {hf_s:>11.1f} {useful / engine_s:>13.1f} {useful / hf_s:>15.1f} "
              f"{ratio:>5.2f}x   (per repeat: {figures[f'hf_generate_ratios{suffix}']})")
    figures["real_load_average"] = [round(x, 1) for x in loads]
    print(f"hf_generate_ratio (fp32/fp32): {figures['hf_generate_ratio']}x   bf16/bf16: {figures['hf_generate_ratio_bf16']}x   "
          f"(1-min load average at each repeat: {figures['real_load_average']})\n")
    model_thread.close()
    return figures


def _prefill(mode: str, length: int) -> dict[str, float | None]:
    out = subprocess.run(
        [sys.executable, "-m", "loadtests.inference", "--prefill-child", mode, str(length)], capture_output=True, text=True, cwd=REPO
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:  # killed (e.g. by the OOM killer) before it could report
        return {"peak_mb": None, "seconds": None}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run under a minute")
    parser.add_argument("--json", type=Path, help="write the figures as one flat JSON object")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: for a tiny model, more threads only add sync overhead)"
    )
    parser.add_argument("--model-dir", type=Path, help="also measure this real model against transformers generate")
    parser.add_argument("--real-requests", type=int, default=32, help="chat requests of the real-model run (default 32)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats of the real-model run (default 2; --quick: 1)")
    parser.add_argument("--real-threads", type=int, default=2, help="torch threads of the real-model run (default 2)")
    parser.add_argument("--prefill-child", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill_child:
        _prefill_child(args.prefill_child[0], int(args.prefill_child[1]))
        return 0

    import torch

    torch.set_num_threads(args.threads)
    new_tokens = 32 if args.quick else 64
    per_stream = {1: 4 if args.quick else 8, 8: 2, 32: 1} if args.quick else {1: 16, 8: 4, 32: 2}
    figures: dict[str, object] = {"torch_threads": args.threads}
    print(f"{'concurrency':>12} {'requests':>9} {'tokens/s':>10}")
    for c in (1, 8, 32):
        tps = asyncio.run(_throughput(c, per_stream[c], new_tokens))
        figures[f"tokens_per_s_c{c}"] = round(tps, 1)
        print(f"{c:>12} {c * per_stream[c]:>9} {tps:>10.1f}")
    figures["concurrency_speedup_c8"] = round(figures["tokens_per_s_c8"] / figures["tokens_per_s_c1"], 2)  # type: ignore[operator]
    figures["concurrency_speedup_c32"] = round(figures["tokens_per_s_c32"] / figures["tokens_per_s_c1"], 2)  # type: ignore[operator]
    print(f"speedup c32 / c1: {figures['concurrency_speedup_c32']}x   (c8 / c1: {figures['concurrency_speedup_c8']}x)\n")

    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384, 32768]
    print(f"{'prompt':>8} {'chunked MB':>11} {'chunked s':>10} {'full MB':>9} {'full s':>8}")
    for n in lengths:
        chunked, full = _prefill("chunked", n), _prefill("full", n)
        figures[f"prefill_peak_mb_chunked_{n}"] = None if chunked["peak_mb"] is None else round(chunked["peak_mb"], 1)
        figures[f"prefill_peak_mb_full_{n}"] = None if full["peak_mb"] is None else round(full["peak_mb"], 1)
        figures[f"prefill_s_chunked_{n}"] = None if chunked["seconds"] is None else round(chunked["seconds"], 2)
        figures[f"prefill_s_full_{n}"] = None if full["seconds"] is None else round(full["seconds"], 2)

        def fmt(v: float | None, width: int) -> str:
            return f"{'fail':>{width}}" if v is None else f"{v:>{width}.1f}"

        print(f"{n:>8} {fmt(chunked['peak_mb'], 11)} {fmt(chunked['seconds'], 10)} {fmt(full['peak_mb'], 9)} {fmt(full['seconds'], 8)}")
    if args.model_dir:
        repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
        figures.update(real_model(args.model_dir, args.real_requests, args.real_threads, repeats))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
