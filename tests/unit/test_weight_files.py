"""Weight files as the learner writes them for publication: the wire dtype, tied tensors written once,
and the manifest's record of the dtype."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch
from safetensors.torch import load_file

from actors.learner import save_weights
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config
from engine.config import LearnerConfig
from streams.weights import safetensors_header, wire_dtype


def _tied_model() -> torch.nn.Module:
    config = tiny_config(len(build_char_tokenizer()))
    config.tie_word_embeddings = True
    return build_tiny_model(config, seed=3)


@pytest.mark.parametrize("dtype, header", [("float32", "F32"), ("bfloat16", "BF16")])
def test_save_weights_writes_floating_tensors_in_the_wire_dtype(tmp_path: Path, dtype: str, header: str) -> None:
    model = _tied_model()
    files = save_weights(model, tmp_path, dtype)
    assert tmp_path / "model.safetensors" in files and tmp_path / "config.json" in files
    tensors = safetensors_header(tmp_path / "model.safetensors")
    assert {t["dtype"] for t in tensors.values()} == {header}
    assert wire_dtype(tensors) == dtype
    # the tied head is the embedding: written once, as save_pretrained does for the model itself
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    saved = load_file(str(tmp_path / "model.safetensors"))
    for name, p in model.state_dict().items():
        if name in saved:
            assert torch.equal(saved[name], p.to(getattr(torch, dtype)))
    # the model itself is untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_wire_dtype_of_a_tensor_table() -> None:
    assert wire_dtype({"a": {"dtype": "BF16", "shape": [2]}, "i": {"dtype": "I64", "shape": [1]}}) == "bfloat16"
    assert wire_dtype({"a": {"dtype": "BF16", "shape": [2]}, "b": {"dtype": "F32", "shape": [2]}}) == "mixed"
    assert wire_dtype({}) == "float32"


def test_publish_dtype_is_float32_unless_set_and_only_float32_or_bfloat16() -> None:
    assert LearnerConfig().publish_dtype == "float32"
    assert LearnerConfig(publish_dtype="bfloat16").publish_dtype == "bfloat16"
    with pytest.raises(pydantic.ValidationError, match="publish_dtype"):
        LearnerConfig(publish_dtype="float16")
