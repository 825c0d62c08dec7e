"""Learner memory and speed: one optimizer step on a real model, new path vs naive, in the same run.

Variants (each runs in its own child process, so its peak RSS is its own ``ru_maxrss``):

- ``packed``: the learner as configured by default: samples that share a prompt packed into one row
  (prompt computed once), micro-batches under ``micro_batch_tokens`` with gradient accumulation,
  log-probs from the hidden states of response positions only, output projection + log-softmax in
  checkpointed chunks (``learning/core.py``).
- ``unpacked``: the same, one row per sample (``share_prefix = false``).
- ``naive``: what the learner did before: the whole batch in one forward pass, full-vocabulary logits
  and log-softmax at every position, one backward.

Workloads: ``long``, 8 groups x 8 samples of a 128-token prompt + 128-token responses (64 samples of
256 tokens); ``short``, 8 x 8 of a 35-token prompt + 8-token responses (a typical GRPO step here).
Token ids are random (the cost does not depend on them); the optimizer is AdamW as in the learner.

    python -m loadtests.learner_memory [--quick] [--json out.json] [--model-dir DIR] [--threads 2]
        [--workloads short,long] [--variants packed,unpacked,naive] [--cap-gb 12]

The model is ``--model-dir``, else ``$ROLLOUT_MODEL_DIR``, else the prepared SmolLM2-135M-Instruct
(``rollout model prepare smollm2-135m``); ``--quick`` falls back to the tiny fixture model when none
is there (labelled so). Each child runs under an address-space limit (``--cap-gb``): a variant that
needs more fails with an allocation error, reported as such, instead of pushing the shared machine
into swap or the OOM killer (the naive path on the long workload needs far more than 6 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


WORKLOADS = {  # name -> (groups, group size, prompt tokens, response tokens)
    "short": (8, 8, 35, 8),
    "long": (8, 8, 128, 128),
}
QUICK_WORKLOADS = {"short": (2, 4, 16, 8), "long": (2, 4, 32, 32)}
VARIANTS = ("packed", "unpacked", "naive")


def _model_dir(arg: str | None, quick: bool) -> str | None:
    if arg:
        return arg
    if os.environ.get("ROLLOUT_MODEL_DIR"):
        return os.environ["ROLLOUT_MODEL_DIR"]
    try:
        from modelserver.prepare import require_model_dir  # type: ignore[import-not-found]
        return str(require_model_dir("smollm2-135m"))
    except Exception as exc:  # missing module or model: only --quick may go on without a real model
        if quick:
            return None
        raise SystemExit(f"no model directory: pass --model-dir or set ROLLOUT_MODEL_DIR ({exc})") from None


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _samples(shape: tuple[int, int, int, int], vocab: int, seed: int = 0) -> list[Any]:
    import numpy as np

    from engine.schemas import Experience

    groups, size, p, r = shape
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(10, vocab, size=p).astype(np.int32)
        adv = rng.normal(size=size)
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)
        for k in range(size):
            out.append(Experience(
                sample_id=f"g{g}-{k}", task_id=f"g{g}", domain="bench", prompt_ids=prompt,
                response_ids=rng.integers(10, vocab, size=r).astype(np.int32),
                logprobs=np.full(r, -2.0, dtype=np.float32), loss_mask=np.ones(r, dtype=np.uint8),
                weight_versions=np.zeros(r, dtype=np.int32), reward=float(adv[k] > 0), advantage=float(adv[k]),
                group_size=size))
    return out


def _naive_step(model: Any, optimizer: Any, samples: list[Any]) -> dict[str, float]:
    """The learner's step before this change: full batch, full-vocabulary logits and log-softmax."""
    import torch

    from learning.core import collate, policy_loss

    batch = collate(samples)
    model.train()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp_all = torch.log_softmax(logits / batch.temperature, dim=-1)  # [B, T, V]
    pred = (batch.target_pos - 1).clamp_min(0)
    targets = batch.input_ids.gather(1, batch.target_pos)
    logp = logp_all.gather(1, pred.unsqueeze(-1).expand(-1, -1, logp_all.shape[-1])).gather(
        -1, targets.unsqueeze(-1)).squeeze(-1)
    loss, stats = policy_loss(logp, logp.detach(), batch.behav_logp, batch.advantages, batch.loss_mask,
                              objective="tis", tis_cap=2.0, clip_eps=0.2)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    model.eval()
    return {"tokens": stats["tokens"], "micro_batches": 1.0, "padded_tokens": float(batch.input_ids.numel())}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant on one workload in this process; returns its figures."""
    if args.cap_gb > 0:
        cap = int(args.cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch

    from learning.core import Learner
    from modelserver.llm import build_char_tokenizer, build_tiny_model, load_model_dir, tiny_config
    from engine.config import LearnerConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model_dir:
        model, tokenizer = load_model_dir(args.model_dir)
    else:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tiny_config(len(tokenizer)), seed=0)
    shape = tuple(json.loads(args.shape))
    samples = _samples(shape, model.config.vocab_size)  # type: ignore[arg-type]
    cfg = LearnerConfig(batch_size=len(samples), micro_batch_tokens=args.micro_batch_tokens,
                        share_prefix=args.child == "packed", autocast=args.autocast,
                        gradient_checkpointing=args.gradient_checkpointing)
    learner = Learner(model, cfg, max_staleness=0)
    rss_loaded = _rss_mb()
    t0 = time.perf_counter()
    try:
        if args.child == "naive":
            stats = _naive_step(model, learner.optimizer, samples)
        else:
            stats = learner.train_on(samples)
        status = "ok"
    except (MemoryError, RuntimeError) as exc:  # the address-space cap: an allocation failed
        stats, status = {}, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"status": status, "seconds": round(seconds, 2), "peak_rss_mb": round(peak, 1),
            "loaded_rss_mb": round(rss_loaded, 1), "tokens": stats.get("tokens", float("nan")),
            "padded_tokens": stats.get("padded_tokens", float("nan")),
            "micro_batches": stats.get("micro_batches", float("nan")), "samples": len(samples),
            "sample_tokens": shape[2] + shape[3]}


def run_child(args: argparse.Namespace, model_dir: str | None, workload: str, variant: str,
              shape: tuple[int, int, int, int]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "loadtests.learner_memory", "--child", variant, "--shape", json.dumps(shape), "--threads", str(args.threads),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--cap-gb", str(args.cap_gb),
           "--autocast", args.autocast]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    if args.gradient_checkpointing:
        cmd.append("--gradient-checkpointing")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": f"failed: exit {proc.returncode}: {tail[:120]}", "seconds": float("nan"),
                "peak_rss_mb": float("nan")}
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run under a minute (small sizes)")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    p.add_argument("--model-dir", help="Hugging Face model directory (default: $ROLLOUT_MODEL_DIR or the prepared one)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--workloads", default="short,long", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--autocast", choices=["off", "bf16"], default="off")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--cap-gb", type=float, default=12.0, help="address-space limit of each child (0: none)")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    model_dir = _model_dir(args.model_dir, args.quick)
    shapes = QUICK_WORKLOADS if args.quick else WORKLOADS
    model_label = model_dir or "tiny fixture model (no real model found)"
    print(f"model: {model_label}; threads {args.threads}; micro_batch_tokens {args.micro_batch_tokens}; "
          f"autocast {args.autocast}; gradient checkpointing {args.gradient_checkpointing}; cap {args.cap_gb} GB")
    header = f"{'workload':<8} {'variant':<9} {'samples':>7} {'tok/sample':>10} {'padded':>7} {'mbs':>4} " \
             f"{'seconds':>8} {'peak RSS MB':>11} {'loaded MB':>9}  status"
    print(header)
    out: dict[str, Any] = {"model": model_label, "threads": args.threads, "micro_batch_tokens": args.micro_batch_tokens,
                           "autocast": args.autocast, "gradient_checkpointing": args.gradient_checkpointing,
                           "quick": args.quick}
    for workload in args.workloads.split(","):
        shape = shapes[workload]
        for variant in args.variants.split(","):
            r = run_child(args, model_dir, workload, variant, shape)
            print(f"{workload:<8} {variant:<9} {r.get('samples', '-'):>7} {r.get('sample_tokens', '-'):>10} "
                  f"{r.get('padded_tokens', float('nan')):>7.0f} {r.get('micro_batches', float('nan')):>4.0f} "
                  f"{r['seconds']:>8.2f} {r['peak_rss_mb']:>11.0f} {r.get('loaded_rss_mb', float('nan')):>9.0f}  "
                  f"{r['status']}", flush=True)
            for key in ("seconds", "peak_rss_mb", "loaded_rss_mb", "padded_tokens", "micro_batches"):
                if key in r:
                    out[f"{workload}_{variant}_{key}"] = r[key]
            out[f"{workload}_{variant}_ok"] = r["status"] == "ok"
    # headline figures
    if out.get("long_packed_ok"):
        out["new_peak_rss_mb"] = out["long_packed_peak_rss_mb"]
        out["new_step_s"] = out["long_packed_seconds"]
    if out.get("long_naive_ok"):
        out["naive_peak_rss_mb"] = out["long_naive_peak_rss_mb"]
    for base in ("unpacked", "naive"):
        if out.get("short_packed_ok") and out.get(f"short_{base}_ok"):
            out[f"short_speedup_over_{base}"] = round(out[f"short_{base}_seconds"] / out["short_packed_seconds"], 2)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
