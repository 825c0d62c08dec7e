"""Runs the plain GRPO loop (``grpo_minimal.py``) unmodified and saves the model it trained.

``python -m loadtests._minimal_runner SCRIPT MODEL_DIR SECONDS SAVE_DIR``: wraps
``transformers.AutoModelForCausalLM.from_pretrained`` to keep the model object the script loads, runs
the script with ``runpy.run_path(SCRIPT, run_name="__main__")`` and ``sys.argv = [SCRIPT, MODEL_DIR,
"--seconds", SECONDS, "--json", SAVE_DIR/result.json]``, then saves that model (and the base model's
tokenizer) into SAVE_DIR with ``save_pretrained``. The script's stdout (its JSON lines) passes through.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any
from pathlib import Path


def main(argv: list[str]) -> int:
    script, model_dir, seconds, save_dir = argv
    import transformers

    original = transformers.AutoModelForCausalLM.from_pretrained
    captured: list[object] = []

    def capture(*args: Any, **kwargs: Any) -> Any:
        model = original(*args, **kwargs)
        captured.append(model)
        return model

    transformers.AutoModelForCausalLM.from_pretrained = capture  # type: ignore[method-assign, assignment]
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    sys.argv = [script, model_dir, "--seconds", seconds, "--json", str(out / "result.json")]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = original  # type: ignore[method-assign]
    if len(captured) != 1:
        raise RuntimeError(f"{script} loaded {len(captured)} models with from_pretrained; expected exactly one")
    captured[0].save_pretrained(out, safe_serialization=True)  # type: ignore[attr-defined]
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
