"""Model directories: every bad input is a clear error naming the file, before anything loads it.

Broken directories are built in tmp_path from symlinks to the prepared SmolLM2-135M-Instruct directory
(read-only; the ``real_model_dir`` fixture fails when it is not prepared) or from the tiny char model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from modelserver import prepare as model_prepare
from modelserver.llm import load_model_dir, write_tiny_model_dir
from modelserver.model_dir import ModelDirError, check_config_model_dir, check_model_dir, gguf_architecture
from modelserver.prepare import (MODEL_ENTRY_POINT_GROUP, MODELS, ModelPrepareError, PreparableModel, prepare_model,
                                  register_model, unregister_model)
from engine.config import ConfigError, load_config
from ops.cli import main as rollout

REPO = Path(__file__).resolve().parents[2]


def linked_copy(src: Path, dst: Path, *, without: tuple[str, ...] = ()) -> Path:
    """``dst`` holding a symlink to each file of ``src`` except ``without`` (the source stays untouched)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name not in without and f.name != "READY":
            (dst / f.name).symlink_to(f.resolve())
    return dst


def write_config(model_dir: Path, **changes: object) -> None:
    """Replace the (symlinked) config.json of ``model_dir`` by a real file with ``changes`` applied."""
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps(config))


def write_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def error_of(path: Path, **kwargs: object) -> ModelDirError:
    with pytest.raises(ModelDirError) as info:
        check_model_dir(path, **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    return info.value


# --- a good directory passes ------------------------------------------------------------------------

def test_the_real_model_dir_passes_every_check(real_model_dir: Path) -> None:
    config = check_model_dir(real_model_dir, need_chat_template=True, min_context=8192)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)


def test_the_char_model_dir_passes_without_a_chat_template(tmp_path: Path) -> None:
    path = write_tiny_model_dir(tmp_path / "tiny", hidden_size=32, intermediate_size=64, num_layers=1)
    check_model_dir(path)
    err = error_of(path, need_chat_template=True)
    assert err.path == path / "tokenizer_config.json" and "no chat template" in str(err)


# --- bad directories -------------------------------------------------------------------------------

def test_missing_directory(tmp_path: Path) -> None:
    err = error_of(tmp_path / "nowhere")
    assert err.path == tmp_path / "nowhere" and "does not exist" in str(err)


def test_a_file_instead_of_a_directory(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"x")
    assert "is not a directory" in str(error_of(tmp_path / "model.bin"))


def test_missing_config(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("config.json",))
    err = error_of(path)
    assert err.path == path / "config.json" and "model config is missing" in str(err)


def test_unparsable_config(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("config.json",))
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    err = error_of(path)
    assert err.path == path / "config.json" and "not valid JSON" in str(err)


def test_unsupported_architecture(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m")
    write_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    err = error_of(path)
    assert err.path == path / "config.json"
    assert "GPT2LMHeadModel is not supported" in str(err) and "Qwen2ForCausalLM" in str(err)


def test_no_architectures_named(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m")
    write_config(path, architectures=[])
    assert "names no architectures" in str(error_of(path))


def test_no_weights(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("model.safetensors",))
    (path / "pytorch_model.bin").write_bytes(b"")
    err = error_of(path)
    assert err.path == path and "no weights" in str(err) and "pytorch_model.bin" in str(err)


def test_sharded_index_with_a_missing_shard(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("model.safetensors",))
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shards[0], "model.norm.weight": shards[1]}}))
    (path / shards[0]).write_bytes(b"")
    err = error_of(path)
    assert err.path == path / shards[1] and "shard listed in model.safetensors.index.json is missing" in str(err)
    (path / shards[1]).write_bytes(b"")
    check_model_dir(path)  # every shard present: passes (the check reads no tensors)


def test_sharded_index_without_a_weight_map(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("model.safetensors",))
    (path / "model.safetensors.index.json").write_text("{}")
    err = error_of(path)
    assert err.path == path / "model.safetensors.index.json" and "no weight_map" in str(err)


def test_missing_tokenizer_files(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("tokenizer.json",))
    err = error_of(path)
    assert err.path == path / "tokenizer.json" and "tokenizer files are missing" in str(err)


def test_tokenizer_without_chat_template(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("chat_template.jinja", "tokenizer_config.json"))
    config = json.loads((real_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    check_model_dir(path)  # a template is required only where prompts are rendered with one
    err = error_of(path, need_chat_template=True)
    assert err.path == path / "tokenizer_config.json" and "no chat template" in str(err)


def test_context_shorter_than_the_prompt_budget(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m")
    write_config(path, max_position_embeddings=256)
    check_model_dir(path, min_context=256)
    err = error_of(path, min_context=1024)
    assert err.path == path / "config.json"
    assert "max_position_embeddings is 256 tokens, shorter than the prompt budget of 1024 tokens" in str(err)


def test_gguf_of_an_unsupported_architecture(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2")
    assert gguf_architecture(file) == "gpt2"
    err = error_of(file)
    assert err.path == file and "GGUF architecture 'gpt2' is not supported" in str(err)


def test_gguf_of_a_supported_architecture_is_named_for_conversion(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "tiny-llama.gguf", "llama")
    err = error_of(file)
    assert "is a GGUF file (llama)" in str(err) and "rollout model prepare --gguf" in str(err)


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    file = tmp_path / "junk.gguf"
    file.write_bytes(b"not a gguf header at all")
    assert "not a readable GGUF file" in str(error_of(file))


# --- the CLI refuses them before any daemon starts ------------------------------------------------------

def test_prepare_gguf_of_unsupported_architecture_fails_before_converting(tmp_path: Path, capsys) -> None:
    file = write_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2")
    assert rollout(["model", "prepare", "--gguf", str(file), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert str(file) in err and "'gpt2' is not supported" in err
    assert not (tmp_path / "out").exists()


def test_inference_serve_refuses_a_bad_model_dir(real_model_dir: Path, tmp_path: Path, capsys) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m", without=("model.safetensors",))
    assert rollout(["inference", "serve", "--port", "0", "--model-dir", str(path)]) == 2
    assert f"--model-dir: {path}: no weights" in capsys.readouterr().err


def test_run_config_check_names_the_file_and_the_field(real_model_dir: Path, tmp_path: Path) -> None:
    path = linked_copy(real_model_dir, tmp_path / "m")
    write_config(path, max_position_embeddings=32)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[inference]\nmodel_dir = "{path}"\nmax_new_tokens = 64\n')
    cfg = load_config(toml, environ={})
    with pytest.raises(ConfigError) as info:
        check_config_model_dir(cfg, toml)
    assert str(info.value).startswith(f"{toml}: inference.model_dir: {path / 'config.json'}: max_position_embeddings is 32")
    check_config_model_dir(load_config(None, environ={}), None)  # no model_dir: a tiny model is built, nothing to check


def test_rollout_run_exits_with_the_error_before_starting(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(f'[inference]\nmodel_dir = "{tmp_path / "absent"}"\n')
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "run", "--config", str(toml)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{toml}: inference.model_dir: {tmp_path / 'absent'}: model directory does not exist" in proc.stderr
    assert '"event": "ready"' not in proc.stdout


# --- loading ---------------------------------------------------------------------------------------

def test_load_model_dir_reads_sharded_safetensors(tmp_path: Path) -> None:
    whole = write_tiny_model_dir(tmp_path / "whole", hidden_size=32, intermediate_size=64, num_layers=2)
    model, tok = load_model_dir(whole)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    tok.save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    again, tok2 = load_model_dir(sharded)
    ids = torch.tensor([tok2.encode("3+4=7")])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    assert tok2.decode(tok2.encode("a\tb\nc")) == "a\tb\nc"  # the char tokenizer still round-trips


def test_load_model_dir_names_a_broken_dir(tmp_path: Path) -> None:
    path = write_tiny_model_dir(tmp_path / "tiny", hidden_size=32, intermediate_size=64, num_layers=1)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="no weights"):
        load_model_dir(path)


def test_chat_template_round_trip_on_the_real_tokenizer(real_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_model_dir), local_files_only=True)
    messages = [{"role": "system", "content": "Answer with just the number."},
                {"role": "user", "content": "What is 12 + 7?\nThink: tabs\tand ünïcode too."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nAnswer with just the number.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(header):] == header and header[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    rendered = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert list(rendered["input_ids"]) == ids  # the template's own tokenisation is the same ids


# --- the cache -------------------------------------------------------------------------------------

def test_prepare_writes_once_into_the_cache_and_is_quick_after(tmp_path: Path, monkeypatch) -> None:
    fetched: list[Path] = []

    class LocalSource:
        def fetch(self, workdir: Path, log) -> Path:
            fetched.append(workdir)
            (workdir / "x.gguf").write_bytes(b"")
            return workdir / "x.gguf"

    def fake_convert(gguf_file: Path, out_dir: Path, *, log) -> Path:
        path = write_tiny_model_dir(out_dir, hidden_size=32, intermediate_size=64, num_layers=1)
        (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
        return path

    register_model(PreparableModel("tiny-test", "tiny-dir", LocalSource()))  # type: ignore[arg-type]
    monkeypatch.setattr(model_prepare, "convert_gguf", fake_convert)
    try:
        _prepare_twice_then_damage(tmp_path, fetched)
    finally:
        unregister_model("tiny-test")
    assert "tiny-test" not in MODELS


def _prepare_twice_then_damage(tmp_path: Path, fetched: list[Path]) -> None:
    first = prepare_model("tiny-test", tmp_path)
    assert first == tmp_path / "models" / "tiny-dir"
    assert prepare_model("tiny-test", tmp_path) == first
    assert len(fetched) == 1
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-dir"]  # no temp dir left behind
    check_model_dir(first, need_chat_template=True)

    (first / "tokenizer.json").unlink()  # a damaged cache entry is reported, not silently reused
    with pytest.raises(ModelPrepareError, match=r"tokenizer files are missing .* remove .* to prepare it again"):
        prepare_model("tiny-test", tmp_path)
    with pytest.raises(ModelPrepareError, match="unknown model 'nope'; preparable: .*smollm2-135m"):
        prepare_model("nope", tmp_path)


def test_models_are_a_registry_refusing_duplicates_and_bad_directory_names() -> None:
    assert MODELS.kind == "model" and MODELS.entry_point_group == MODEL_ENTRY_POINT_GROUP == "rollout_engine.models"
    builtin = MODELS["smollm2-135m"]
    assert builtin.dir_name == "smollm2-135m-instruct" and MODELS.origin("smollm2-135m") == ""
    with pytest.raises(ValueError, match="'smollm2-135m' is already registered"):
        register_model(builtin)
    for bad in ("../escape", "a/b", ".."):
        with pytest.raises(ValueError, match="must be one directory name"):
            register_model(PreparableModel("bad-dir-test", bad, builtin.source))
    assert "bad-dir-test" not in MODELS


def _dist(site: Path, name: str, entry_points: str) -> None:
    """A minimal installed distribution (what pip writes): importlib.metadata finds its entry points."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_an_installed_package_adds_models_through_the_entry_point_group(tmp_path: Path) -> None:
    """A separate `rollout` process (entry points load once per process) sees the plugin's models in
    `model list`; a plugin that fails to import is listed as unavailable and `prepare` says why."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "my_models.py").write_text(
        "from modelserver.prepare import PreparableModel, WheelGGUF\n"
        "MODELS = [PreparableModel('tiny-plugin', 'tiny-plugin-dir', WheelGGUF('tiny-plugin==1.0', 'm.gguf'),\n"
        "                          description='a plugin model')]\n")
    _dist(site, "my-models", f"[{MODEL_ENTRY_POINT_GROUP}]\ntiny = my_models:MODELS\nbroken = no_such_models_mod:X\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    cache = tmp_path / "cache"

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ops.cli", "model", *argv], capture_output=True, text=True,
                              env=env, timeout=120)

    listing = run("list", "--cache-dir", str(cache))
    assert listing.returncode == 0, listing.stderr
    rows = {line.split("\t")[0]: line.split("\t") for line in listing.stdout.splitlines()}
    assert rows["tiny-plugin"] == ["tiny-plugin", "not prepared", str(cache / "models" / "tiny-plugin-dir"),
                                   "a plugin model"]
    assert rows["smollm2-135m"][1] in ("prepared", "not prepared")
    assert rows["broken"][1] == "unavailable" and "ModuleNotFoundError" in rows["broken"][3]
    refused = run("prepare", "broken", "--cache-dir", str(cache))
    assert refused.returncode == 1
    assert "model 'broken' is unavailable here: entry point broken = no_such_models_mod:X" in refused.stderr
