"""Fit the roofline's constants to the LOCAL engine's measured timings on this CPU (the sim's reality check).

Why: the roofline is only as good as its shape. Here the real local engine runs the real model;
prefill time vs prompt tokens and decode-step time vs batch are measured, the roofline's linear forms
are fitted (effective FLOP/s, effective bytes/s, per-step overhead), and the fit's mean relative error
is reported. Run: ``python -m modelserver.sim.calibrate --model-dir DIR [--json F]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from modelserver.local.engine import LocalEngine
from modelserver.local.protocol import SamplingParams


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _rel_error(xs: list[float], ys: list[float], fit: tuple[float, float]) -> float:
    return sum(abs(fit[0] + fit[1] * x - y) / y for x, y in zip(xs, ys)) / len(xs)


async def _timed(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.submit(p, params) for p in prompts]
    for s in seqs:
        while not s.finished:
            await s.wait_changed()
    return time.perf_counter() - start


async def measure(model_dir: str, *, prompt_lens: list[int], batches: list[int], repeats: int = 3) -> dict[str, Any]:
    from modelserver.llm import load_model_dir

    model, tokenizer = load_model_dir(model_dir)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = LocalEngine(model, tokenizer, max_batch=max(batches), chunk_size=max(prompt_lens))
    await engine.start()
    try:
        await _timed(engine, [[5] * 16], 2)  # warm-up
        prefill = [min([await _timed(engine, [[5 + i % 100 for i in range(n)]], 1) for _ in range(repeats)]) for n in prompt_lens]
        ctx, k1, k2 = 64, 2, 34
        decode = []
        for b in batches:
            prompts = [[5 + j] * ctx for j in range(b)]
            t1 = min([await _timed(engine, prompts, k1) for _ in range(repeats)])
            t2 = min([await _timed(engine, prompts, k2) for _ in range(repeats)])
            decode.append((t2 - t1) / (k2 - k1))
    finally:
        await engine.aclose()
    pf = _linear_fit([float(n) for n in prompt_lens], prefill)
    kv_tokens = [float(b * (ctx + (k1 + k2) / 2)) for b in batches]
    df = _linear_fit(kv_tokens, decode)
    errors = {"prefill": _rel_error([float(n) for n in prompt_lens], prefill, pf), "decode": _rel_error(kv_tokens, decode, df)}
    return {
        "simulated": False,
        "what": "local engine (real model, this CPU) timings and the roofline fit to them",
        "params": params,
        "prefill": {"tokens": prompt_lens, "seconds": prefill, "overhead_s": pf[0],
                    "effective_flops": 2 * params / pf[1] if pf[1] > 0 else None},
        "decode": {"batch": batches, "kv_tokens": kv_tokens, "step_seconds": decode, "step_overhead_plus_weights_s": df[0],
                   "effective_bytes_per_s": weight_bytes / df[0] if df[0] > 0 else None},
        "fit_error": errors,
        "calibration_error": max(errors.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--repeats", type=int, default=3, help="timings per point, the best kept (default 3)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    lens = [32, 128, 256] if args.quick else [32, 64, 128, 256, 512]
    batches = [1, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    result = asyncio.run(measure(args.model_dir, prompt_lens=lens, batches=batches, repeats=args.repeats))
    print(f"{'prefill tokens':>15} {'seconds':>9}")
    for n, t in zip(lens, result["prefill"]["seconds"]):
        print(f"{n:>15} {t:>9.4f}")
    print(f"{'decode batch':>15} {'step s':>9}")
    for b, t in zip(batches, result["decode"]["step_seconds"]):
        print(f"{b:>15} {t:>9.4f}")
    print(f"fit error: prefill {result['fit_error']['prefill']:.1%}, decode {result['fit_error']['decode']:.1%} "
          f"(calibration_error {result['calibration_error']:.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
