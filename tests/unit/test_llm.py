"""The locally built tokenizer and tiny model: determinism, coverage, HF layout round trip."""

from __future__ import annotations

from pathlib import Path

import torch

from modelserver.llm import CHARSET, build_char_tokenizer, build_tiny_model, load_model_dir, tiny_config, write_tiny_model_dir


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
