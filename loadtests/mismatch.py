"""Train/serve mismatch of the local server, and what re-scoring costs: per-token gap and throughput.

For each serving dtype (fp32, bf16) and with the server's ``rescore`` off and on, the same requests
(``--prompts`` chat prompts x 2 samples, ``--new-tokens`` tokens each, T = 0.7, all in flight together:
batched decode) go through an in-process ``LocalEngine``; every sampled token's reported log-prob is
compared with the fp32 learner's (``learning.core.score_tokens``, the sample alone, same weights):
``|learner - server|`` p50 / p99 / max and the largest ``|learner - server| / max(1, |logp|)``.
Throughput is output tokens per second of the whole batch, end to end (re-scoring included);
``rescore_cost_<dtype>`` = tokens/s with re-scoring over tokens/s without, same run, same requests
(repeats interleave the two).

    python -m loadtests.mismatch [--model-dir DIR] [--quick] [--json PATH]

Then the learner's side: one training step (``Learner.train_on``, on a fresh copy of the served weights each
time) on the fp32 re-scored samples, in each layout of ``PACKINGS``: ``rows`` (``learner.packing = "rows"``,
padded rows, ``share_prefix`` off), ``rows_shared`` (the same with a group's prompt shared: the default config)
and ``per_sample`` (one forward per sample, ``score_tokens``' shapes). The step's own same-version gap
(``mismatch_max``, what the learner's metrics report) and its time: ``train_gap_<layout>_max``,
``train_step_s_<layout>`` (median), ``per_sample_step_cost`` = step time per_sample over rows,
``per_sample_step_cost_vs_default`` over rows_shared (repeats interleave the three).

``--model-dir`` defaults to the prepared SmolLM2-135M-Instruct. Headline keys: ``rescore_cost_fp32``,
``rescore_cost_bf16``, ``gap_<dtype>_<rescore|decode>_{p50,p99,max,rel_max}``, ``train_gap_<layout>_max``,
``per_sample_step_cost``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

QUESTIONS = ("What is 4 + 5?", "Say hello in French.", "Name a prime number.", "Write a haiku about rain.",
             "What colour is the sky?", "Count to five.", "Who wrote Hamlet?", "Spell 'cat' backwards.")
T = 0.7


def _chat(tokenizer: Any, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def _run(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int, dtype: str,
               rescore: bool) -> tuple[float, list[tuple[list[int], list[int], list[float]]]]:
    from learning.core import score_tokens
    from modelserver.local.engine import LocalEngine
    from modelserver.local.protocol import SamplingParams

    engine = LocalEngine(model, tokenizer, max_batch=64, chunk_size=512, dtype=dtype,
                         rescore=score_tokens if rescore else None)
    await engine.start()
    try:
        started = time.perf_counter()
        seqs = [(p, engine.submit(p, SamplingParams(max_new_tokens=new_tokens, temperature=T, sampling_seed=i,
                                                    ignore_eos=True)))
                for i, p in enumerate(prompts * 2)]
        for _, s in seqs:
            while not s.finished:
                await s.wait_changed()
        elapsed = time.perf_counter() - started
    finally:
        await engine.aclose()
    tokens = sum(len(s.output_ids) for _, s in seqs)
    return tokens / elapsed, [(p, list(s.output_ids), list(s.logprobs)) for p, s in seqs]


def _gaps(learner: Any, samples: list[tuple[list[int], list[int], list[float]]]) -> dict[str, float]:
    from learning.core import score_tokens

    absolute, relative = [], []
    for prompt, output, served in samples:
        ours = torch.tensor(score_tokens(learner, prompt, output, T), dtype=torch.float64)
        theirs = torch.tensor(served, dtype=torch.float64)
        d = (ours - theirs).abs()
        absolute.append(d)
        relative.append(d / ours.abs().clamp_min(1.0))
    a, r = torch.cat(absolute), torch.cat(relative)
    q = torch.quantile(a, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return {"p50": q[0], "p99": q[1], "max": float(a.max()), "rel_max": float(r.max()), "tokens": float(a.numel())}


PACKINGS = {"rows": ("rows", False), "rows_shared": ("rows", True), "per_sample": ("per_sample", False)}
"""The learner step's layouts compared: padded rows, the same with a group's prompt shared (the default
``learner`` config), one forward per sample."""


def _train_steps(model: Any, samples: list[tuple[list[int], list[int], list[float]]], repeats: int
                 ) -> dict[str, float]:
    """The learner's step on same-version samples under each packing: its mismatch figure and its time."""
    import numpy as np

    from engine.config import LearnerConfig
    from engine.schemas import Experience
    from learning.core import Learner

    exps = [Experience(sample_id=f"s{i}", task_id="t", domain="d", prompt_ids=np.asarray(prompt, np.int32),
                       response_ids=np.asarray(output, np.int32), logprobs=np.asarray(served, np.float32),
                       loss_mask=np.ones(len(output), np.uint8), weight_versions=np.zeros(len(output), np.int32),
                       reward=0.0, advantage=1.0, group_size=1, temperature=T)
            for i, (prompt, output, served) in enumerate(samples)]
    out: dict[str, float] = {}
    times: dict[str, list[float]] = {name: [] for name in PACKINGS}
    for _ in range(repeats):
        for name, (packing, share_prefix) in PACKINGS.items():
            cfg = LearnerConfig(batch_size=len(exps), share_prefix=share_prefix, lr=1e-6, packing=packing)
            learner = Learner(copy.deepcopy(model), cfg, max_staleness=4)  # a step moves the weights
            started = time.perf_counter()
            stats = learner.train_on(exps)
            times[name].append(time.perf_counter() - started)
            out[f"train_gap_{name}_max"] = stats["mismatch_max"]
            out[f"train_micro_batches_{name}"] = stats["micro_batches"]
    for name, ts in times.items():
        out[f"train_step_s_{name}"] = statistics.median(ts)
    out["per_sample_step_cost"] = out["train_step_s_per_sample"] / out["train_step_s_rows"]
    out["per_sample_step_cost_vs_default"] = out["train_step_s_per_sample"] / out["train_step_s_rows_shared"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens, 1 repeat")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats = 4, 16, 1
    torch.set_num_threads(args.threads)
    from modelserver.llm import load_model_dir

    if args.model_dir is None:
        from modelserver.prepare import require_model_dir

        args.model_dir = str(require_model_dir("smollm2-135m"))
    learner, tokenizer = load_model_dir(Path(args.model_dir))
    learner.eval()
    prompts = [_chat(tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.prompts)]
    out: dict[str, Any] = {"model_dir": args.model_dir, "prompts": args.prompts, "samples": 2 * args.prompts,
                           "new_tokens": args.new_tokens, "temperature": T, "threads": args.threads,
                           "repeats": args.repeats}
    print(f"{'serving':>8} {'logprobs':>9} {'tok/s':>8} {'p50':>9} {'p99':>9} {'max':>9} {'rel max':>9}")
    rescored: list[tuple[list[int], list[int], list[float]]] = []
    for dtype in ("fp32", "bf16"):
        served = copy.deepcopy(learner)  # the engine casts its model in place (bf16)
        speeds: dict[bool, list[float]] = {False: [], True: []}
        last: dict[bool, Any] = {}
        for _ in range(args.repeats):
            for rescore in (False, True):
                tps, samples = asyncio.run(_run(served, tokenizer, prompts, args.new_tokens, dtype, rescore))
                speeds[rescore].append(tps)
                last[rescore] = samples
        for rescore in (False, True):
            g = _gaps(learner, last[rescore])
            name = f"gap_{dtype}_{'rescore' if rescore else 'decode'}"
            out.update({f"{name}_{k}": v for k, v in g.items()})
            tps = statistics.median(speeds[rescore])
            out[f"tokens_per_s_{dtype}_{'rescore' if rescore else 'decode'}"] = tps
            print(f"{dtype:>8} {'rescored' if rescore else 'decode':>9} {tps:8.1f} {g['p50']:9.2e} {g['p99']:9.2e} "
                  f"{g['max']:9.2e} {g['rel_max']:9.2e}")
        out[f"rescore_cost_{dtype}"] = statistics.median(speeds[True]) / statistics.median(speeds[False])
        print(f"{dtype}: throughput with re-scoring / without = {out[f'rescore_cost_{dtype}']:.3f}")
        if dtype == "fp32":
            rescored = last[True]
    train = _train_steps(learner, rescored, args.repeats)
    out.update(train)
    print(f"\nlearner step on the {len(rescored)} fp32 re-scored samples (same version):")
    print(f"{'packing':>11} {'forwards':>8} {'step s':>8} {'gap max':>9}")
    for name in PACKINGS:
        print(f"{name:>11} {train[f'train_micro_batches_{name}']:8.0f} {train[f'train_step_s_{name}']:8.2f} "
              f"{train[f'train_gap_{name}_max']:9.2e}")
    print(f"per_sample step time / rows = {train['per_sample_step_cost']:.2f}, "
          f"/ rows_shared (the default) = {train['per_sample_step_cost_vs_default']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
