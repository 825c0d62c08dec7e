"""The learning benchmark's task, reward rule and held-out evaluation: the plain loop's, restated.

``loadtests/learning.py`` compares systems on the task of the plain GRPO loop
(``../shared/baselines/grpo_minimal.py``): "What is A op B? Answer with just the number." with A, B in
1..9 and op in + - *, reward 1 iff the FIRST integer of the answer is right. Its held-out rule: 48
tasks drawn from ``random.Random(12345)``, 4 samples each at temperature 1, 8 new tokens, prompts
rendered with the model's chat template. The two functions below are the loop's own, restated so the
benchmark does not depend on where the loop lives; ``tests/unit/test_learning_benchmark.py`` checks
that they agree with the loop's on every task.

:func:`heldout_accuracy` is the ONE evaluation every system's saved weights (and the base model) are
scored with, in one process after all systems ran, seeded per model, so no system is judged by its own
evaluator and two models differ only by their weights. Run as a script it scores directories and
prints one JSON object: ``python -m loadtests._learning_task --base BASE NAME=DIR ... --json OUT``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path

HELDOUT_SEED = 12345
HELDOUT_TASKS = 48
SAMPLES_PER_TASK = 4
NEW_TOKENS = 8
CHUNK = 16
"""Tasks per ``generate`` call (the loop's chunk: 16 prompts x 4 samples)."""


def task(rng: random.Random) -> tuple[str, int]:
    """One task ``(question, answer)``, drawn exactly as the plain loop draws it."""
    op = rng.choice(["+", "-", "*"])
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} {op} {b}? Answer with just the number.", {"+": a + b, "-": a - b, "*": a * b}[op]


def first_number_right(text: str, answer: int) -> float:
    """1.0 iff the first integer in ``text`` is ``answer`` (the loop's reward)."""
    nums = re.findall(r"-?\d+", text)
    return float(bool(nums) and int(nums[0]) == answer)


def heldout_tasks(n: int = HELDOUT_TASKS) -> list[tuple[str, int]]:
    """The first ``n`` of the loop's held-out tasks (``n`` = 48 is the loop's whole set)."""
    rng = random.Random(HELDOUT_SEED)
    return [task(rng) for _ in range(n)]


def heldout_accuracy(model_dir: str | Path, tokenizer_dir: str | Path, *, tasks: int = HELDOUT_TASKS,
                     samples: int = SAMPLES_PER_TASK, seed: int = 0) -> float:
    """Sampled held-out accuracy of the weights in ``model_dir`` by the plain loop's rule.

    The tokenizer (and so the chat template) comes from ``tokenizer_dir`` for every model: no system
    trains it. ``torch.manual_seed(seed)`` right before sampling makes two calls with the same weights
    give the same figure.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    held = heldout_tasks(tasks)
    torch.manual_seed(seed)
    right, total = 0.0, 0
    for i in range(0, len(held), CHUNK):
        chunk = held[i:i + CHUNK]
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                 for q, _ in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id, do_sample=True,
                                 temperature=1.0, top_p=1.0, num_return_sequences=samples)
        prompt_len = enc["input_ids"].shape[1]
        for j, o in enumerate(out):
            right += first_number_right(str(tok.decode(o[prompt_len:], skip_special_tokens=True)), chunk[j // samples][1])
            total += 1
    return right / total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="score model directories by the plain loop's held-out rule")
    p.add_argument("--base", required=True, help="the base model directory (its tokenizer is used for all)")
    p.add_argument("--tasks", type=int, default=HELDOUT_TASKS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    p.add_argument("models", nargs="*", help="NAME=DIR to score besides the base model (scored as 'base')")
    args = p.parse_args(argv)
    out: dict[str, float | str] = {}
    for name, path in [("base", args.base)] + [m.split("=", 1) for m in args.models]:
        try:
            out[name] = round(heldout_accuracy(path, args.base, tasks=args.tasks, seed=args.seed), 4)
        except Exception as exc:  # one unreadable directory must not cost the others their score
            out[name] = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
        print(json.dumps({name: out[name]}), flush=True)
    Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
