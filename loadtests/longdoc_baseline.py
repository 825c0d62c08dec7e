"""Long-document baseline: a real model's held-out ``longdoc`` accuracy at each document length.

Why: the context-length curriculum and any long-context change (e.g. sparse attention) are judged against
what the untrained model scores; this measures it with :func:`domains.longdoc.longdoc_accuracy`
(greedy decoding, the model's chat template, the domain's strict ``Answer: <value>`` format). Alongside
the accuracy it reports how many completions had the strict format at all, since a small model's usual
failure is the format, not the value. Nothing is simulated: the model runs on CPU with transformers.

    python -m loadtests.longdoc_baseline --quick --json runs/longdoc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from domains.longdoc import longdoc_accuracy, longdoc_format

DEFAULT_MODEL = Path.home() / ".cache/rollout-engine/models/smollm2-135m-instruct"


def measure(model_dir: Path, lengths: list[int], n: int, seed: int) -> list[dict[str, Any]]:
    """One row per length: accuracy, strict-format rate and seconds, over ``n`` held-out tasks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for tokens in lengths:
        texts: list[str] = []

        def generate(messages: list[dict]) -> str:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=12, do_sample=False)
            texts.append(str(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
            return texts[-1]

        t0 = time.monotonic()
        accuracy = longdoc_accuracy(generate, n, tokens, seed)
        rows.append({"tokens": tokens, "n": len(texts), "accuracy": accuracy,
                     "strict_format": sum(longdoc_format(t) for t in texts) / len(texts),
                     "seconds": round(time.monotonic() - t0, 1), "example": texts[0]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 tasks at 1000 and 2000 tokens (about 2 min)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    parser.add_argument("--n", type=int, default=32, help="held-out tasks per length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.n = [1000, 2000], 8
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json (rollout model fetch prepares it)")
    import torch

    torch.set_num_threads(args.threads)
    rows = measure(args.model_dir, args.lengths, args.n, args.seed)
    print(f"model {args.model_dir.name} (real, greedy, CPU)")
    print(f"{'tokens':>8}{'n':>5}{'accuracy':>10}{'strict fmt':>12}{'seconds':>9}  first completion")
    for r in rows:
        print(f"{r['tokens']:>8}{r['n']:>5}{r['accuracy']:>10.3f}{r['strict_format']:>12.3f}{r['seconds']:>9}  "
              f"{r['example']!r}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": str(args.model_dir), "simulated": False, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
