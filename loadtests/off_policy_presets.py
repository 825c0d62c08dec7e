"""What each off-policy preset masks when a bf16 engine samples and the fp32 learner trains (a foreign engine's stand-in).

The behaviour policy is the model in bfloat16 (``transformers`` forward, sampling at temperature 1 from
its own log-softmax, whose log-probs are recorded as a server would report them); the learner is the
same weights in float32 scoring the same tokens with ``learning.core.response_logprobs``. Same weights on
both sides, so every gap is numerics (a same-version sample). Per preset (``learning.core.behaviour_weights``
with its default band): the fraction of tokens masked and truncated and the mean weight; and the per-token
|logp_learner - logp_behaviour| p50/p99/max.

    python -m loadtests.off_policy_presets [--model-dir D] [--prompts 8] [--tokens 96] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_MODEL_DIR = Path.home() / ".cache/rollout-engine/models/smollm2-135m-instruct"
PROMPTS = ["What is 17 * 23?", "Write a haiku about rivers.", "Explain recursion to a child.",
           "List three prime numbers above 100.", "Translate 'good morning' into French.",
           "Why is the sky blue?", "Give a Python one-liner that reverses a string.", "Name the planets in order."]


def sample_bf16(model: Any, prompt_ids: list[int], tokens: int, seed: int) -> tuple[list[int], list[float]]:
    """Sample ``tokens`` tokens at temperature 1 from ``model`` (bf16), with each token's bf16 log-prob."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids])
    out_ids: list[int] = []
    out_lp: list[float] = []
    past = None
    with torch.no_grad():
        for _ in range(tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logp = torch.log_softmax(res.logits[0, -1].float(), dim=-1)  # bf16 logits, as a bf16 server has them
            tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            out_ids.append(tok)
            out_lp.append(float(logp[tok]))
            ids = torch.tensor([[tok]])
    return out_ids, out_lp


def measure(model_dir: Path, n_prompts: int, tokens: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.schemas import Experience
    from learning.core import OFF_POLICY_PRESETS, behaviour_weights, collate, response_logprobs

    tok = AutoTokenizer.from_pretrained(model_dir)
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    samples = []
    for i, text in enumerate((PROMPTS * (n_prompts // len(PROMPTS) + 1))[:n_prompts]):
        chat = str(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False))
        prompt: list[int] = tok.encode(chat, add_special_tokens=False)
        resp, lp = sample_bf16(bf16, prompt, tokens, seed=i)
        n = len(resp)
        samples.append(Experience(
            sample_id=f"s{i}", task_id=f"t{i}", domain="chat", prompt_ids=np.asarray(prompt, dtype=np.int32),
            response_ids=np.asarray(resp, dtype=np.int32), logprobs=np.asarray(lp, dtype=np.float32),
            loss_mask=np.ones(n, dtype=np.uint8), weight_versions=np.zeros(n, dtype=np.int32), reward=0.0,
            advantage=0.0, group_size=1))
    batch = collate(samples, tok.pad_token_id or 0)
    with torch.no_grad():
        learner = response_logprobs(fp32, batch)
    mask = batch.loss_mask
    log_ratio = torch.where(mask, learner - batch.behav_logp, torch.zeros_like(learner))
    gap = log_ratio[mask].abs().numpy()
    out: dict[str, Any] = {
        "model_dir": str(model_dir), "behaviour": "bf16 transformers forward, T=1", "learner": "fp32",
        "prompts": n_prompts, "tokens": int(mask.sum()),
        "abs_logp_gap_p50": float(np.quantile(gap, 0.5)), "abs_logp_gap_p99": float(np.quantile(gap, 0.99)),
        "abs_logp_gap_max": float(gap.max()), "presets": {}}
    for preset in OFF_POLICY_PRESETS:
        w, flags = behaviour_weights(log_ratio, mask, preset=preset)
        n_tok = float(mask.sum())
        row = {"masked_frac": float(flags["masked"].sum()) / n_tok,
               "truncated_frac": float(flags["truncated"].sum()) / n_tok,
               "weight_mean": float(w[mask].mean()),
               "sequences_masked": int(sum(bool(flags["masked"][i][mask[i]].all()) for i in range(len(samples))))}
        out["presets"][preset] = row
        out[f"masked_frac_{preset}"] = row["masked_frac"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        p.error("--prompts and --tokens must be >= 1")
    if not (Path(args.model_dir) / "config.json").exists():
        p.error(f"no model at {args.model_dir} (run `make setup` or pass --model-dir)")
    out = measure(Path(args.model_dir), args.prompts, args.tokens)
    print(f"bf16 behaviour vs fp32 learner, {out['prompts']} prompts, {out['tokens']} tokens: |gap| p50 "
          f"{out['abs_logp_gap_p50']:.2e}, p99 {out['abs_logp_gap_p99']:.2e}, max {out['abs_logp_gap_max']:.2e}")
    print(f"{'preset':<11}{'masked':>9}{'truncated':>11}{'mean w':>9}{'seqs masked':>13}")
    for name, r in out["presets"].items():
        print(f"{name:<11}{r['masked_frac']:>9.4f}{r['truncated_frac']:>11.4f}{r['weight_mean']:>9.4f}"
              f"{r['sequences_masked']:>13}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
