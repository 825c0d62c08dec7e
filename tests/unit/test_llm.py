"""The locally built tokenizer and tiny model: determinism, coverage, HF layout round trip."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from modelserver.llm import (CHARSET, build_char_tokenizer, build_tiny_model, check_tied, load_model_dir,
                             save_model_dir, tiny_config, write_tiny_model_dir)
from modelserver.model_dir import ModelDirError


def test_tokenizer_round_trips_code_math_and_shell() -> None:
    tok = build_char_tokenizer()
    text = "def f(x):\n\treturn x ** 2 + 3 / 4  # ok\n$ ls -la | grep '*.py' && echo \"done\"; 12345-67=?"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, no special tokens added
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids
    assert len(tok) == 4 + len(CHARSET)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_tiny_model_is_deterministic_given_a_seed() -> None:
    tok = build_char_tokenizer()
    a = build_tiny_model(tiny_config(len(tok)), seed=3)
    b = build_tiny_model(tiny_config(len(tok)), seed=3)
    c = build_tiny_model(tiny_config(len(tok)), seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.state_dict()["lm_head.weight"], c.state_dict()["lm_head.weight"])
    assert a.config.vocab_size == len(tok)


def test_model_dir_round_trip(tmp_path: Path) -> None:
    path = write_tiny_model_dir(tmp_path / "m", seed=0, num_layers=3)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    model, tok = load_model_dir(path)
    reference = build_tiny_model(tiny_config(len(tok), num_layers=3), seed=0)
    ids = torch.tensor([tok.encode("print(1+1)")])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert tok.decode(tok.encode("a\tb\nc")) == "a\tb\nc"


def _tied_model_dir(path: Path) -> Path:
    tok = build_char_tokenizer()
    config = tiny_config(len(tok))
    config.tie_word_embeddings = True
    return save_model_dir(build_tiny_model(config, seed=5), tok, path)


def _tied(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_loads_in_many_threads_at_once_all_come_back_tied(tmp_path: Path) -> None:
    """transformers 5 switches tying off by swapping ``PreTrainedModel.tie_weights`` on the class for the length
    of a load; unserialised loads in threads (the local server's and the learner's) could leave it off for good,
    and every later load's head uninitialised (what broke SmolLM2 in the suite)."""
    path = _tied_model_dir(tmp_path / "tied")
    original = PreTrainedModel.tie_weights
    with ThreadPoolExecutor(8) as pool:
        models = list(pool.map(lambda _: load_model_dir(path)[0], range(16)))
    assert PreTrainedModel.tie_weights is original
    assert all(_tied(m) for m in models)


def test_a_class_left_untied_by_someone_elses_load_is_repaired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tied_model_dir(tmp_path / "tied")
    original = PreTrainedModel.tie_weights
    monkeypatch.setattr(PreTrainedModel, "tie_weights", lambda *args, **kwargs: None)  # the race's end state
    model, _ = load_model_dir(path)
    assert _tied(model) and PreTrainedModel.tie_weights is original


def test_a_model_configured_tied_but_loaded_apart_is_refused(tmp_path: Path) -> None:
    model, _ = load_model_dir(_tied_model_dir(tmp_path / "tied"))
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(ModelDirError, match="ties the output head to the embedding"):
        check_tied(model, tmp_path / "tied")
