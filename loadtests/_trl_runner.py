"""TRL's ``GRPOTrainer`` on the learning benchmark's task, for a wall-clock budget; saves the final model.

``python -m loadtests._trl_runner MODEL_DIR SECONDS SAVE_DIR``. The plain loop's task and reward
(``loadtests/_learning_task.py``) and geometry: 8 prompts x 8 generations per optimizer step
(micro-batches of 16 completions, 4 accumulated), lr 5e-6 constant, 8 new tokens, temperature 1,
gradient checkpointing, TRL's default loss. The budget starts once the model is loaded (as the plain
loop's does) and is checked at the end of every step (a ``TrainerCallback``), so at least one step
runs. Prints one JSON line per step, ``{"step", "t", "train_reward"}``, and saves model and tokenizer
into SAVE_DIR. Exits 3 when ``trl`` is not importable.

:func:`train_grpo` is that trainer for any rows and reward functions (``loadtests/_trl_multidomain.py``
runs it on the multi-domain benchmark's mixed dataset).
"""

from __future__ import annotations

import importlib
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtests._learning_task import first_number_right, task  # noqa: E402

NOT_INSTALLED = 3
TRAIN_TASKS = 20000


def trl_available() -> str | None:
    """None when ``trl`` imports, else why not (one line)."""
    try:
        importlib.import_module("trl")
    except ImportError as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def completion_text(completion: Any) -> str:
    """The text of one TRL completion (conversational: a list of messages; else a string)."""
    return str(completion[0]["content"] if isinstance(completion, list) else completion)


def train_grpo(model_dir: str, seconds: float, save_dir: Path, rows: list[dict[str, Any]],
               reward_funcs: Callable[..., list[float | None]] | Sequence[Callable[..., list[float | None]]], *,
               max_completion_length: int, temperature: float = 1.0, seed: int = 0) -> int:
    """Train with ``GRPOTrainer`` on ``rows`` (each with a conversational ``prompt``) for ``seconds`` of wall
    clock after loading, at the benchmark's geometry; save model and tokenizer into ``save_dir``. Returns the
    exit status (``NOT_INSTALLED`` without ``trl``)."""
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        print(f"trl not installed: {exc}", file=sys.stderr)
        return NOT_INSTALLED
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t0 = time.monotonic()

    class Budget(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if time.monotonic() - t0 >= seconds:
                control.should_training_stop = True
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if logs and "reward" in logs:
                print(json.dumps({"step": state.global_step, "t": round(time.monotonic() - t0, 1),
                                  "train_reward": round(float(logs["reward"]), 3)}), flush=True)

    scratch = tempfile.mkdtemp(prefix="rollout-trl-")  # the trainer's output_dir; nothing is saved there
    cfg = GRPOConfig(
        output_dir=scratch, per_device_train_batch_size=16, gradient_accumulation_steps=4,
        num_generations=8, max_completion_length=max_completion_length, temperature=temperature,
        learning_rate=5e-6, lr_scheduler_type="constant", gradient_checkpointing=True, max_steps=10 ** 6,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=seed, dataloader_num_workers=0)
    funcs: Any = reward_funcs if callable(reward_funcs) else list(reward_funcs)  # TRL wants a list (invariant)
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Budget()])
    try:
        trainer.train()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    trainer.save_model(str(save_dir))
    tok.save_pretrained(str(save_dir))
    print(json.dumps({"steps": trainer.state.global_step, "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    model_dir, seconds, save_dir = argv[0], float(argv[1]), Path(argv[2])
    why = trl_available()
    if why is not None:
        print(f"trl not installed: {why}", file=sys.stderr)
        return NOT_INSTALLED
    rng = random.Random(1)  # the plain loop's training stream
    rows = []
    for _ in range(TRAIN_TASKS):
        q, a = task(rng)
        rows.append({"prompt": [{"role": "user", "content": q}], "answer": a})

    def reward(completions: list, answer: list, **_: object) -> list[float | None]:
        return [first_number_right(completion_text(c), a) for c, a in zip(completions, answer)]

    return train_grpo(model_dir, seconds, save_dir, rows, reward, max_completion_length=8)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
