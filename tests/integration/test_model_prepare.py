"""`rollout model prepare smollm2-135m`: prints the cached directory last, is idempotent, and the
directory loads and answers a chat-templated question.

The test runs the command once. On a set-up machine (ops/bootstrap.sh prepares the model) it finds
the cache and must leave it untouched; on a bare one it downloads (~100 MB) and converts (~20 s).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelserver.llm import load_model_dir
from modelserver.model_dir import check_model_dir
from modelserver.prepare import cached_model_dir

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(600)]


def test_prepare_prints_the_cached_dir_last_and_is_idempotent() -> None:
    target = cached_model_dir("smollm2-135m")
    weights = target / "model.safetensors"
    before = weights.stat() if weights.is_file() else None
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "model", "prepare", "smollm2-135m"], cwd=REPO,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip().splitlines()[-1]) == target.resolve()
    if before is not None:  # already prepared: nothing is fetched, converted or rewritten
        assert "already prepared" in proc.stderr and "downloading" not in proc.stderr
        after = weights.stat()
        assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind

    config = check_model_dir(target, need_chat_template=True, min_context=8192)
    assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (30, 576, True)
    model, tok = load_model_dir(target)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer
