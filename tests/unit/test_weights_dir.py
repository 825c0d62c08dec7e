"""A published weight version is a complete Hugging Face directory that SGLang's
``/update_weights_from_disk`` (and a fresh ``--model-path``) can load; an incomplete one is refused.

The object store and KV are an in-memory stand-in with the four methods the publisher and subscriber
use, so the whole publish -> fetch path runs without NATS (the real one: tests/integration).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from modelserver.llm import build_char_tokenizer, build_tiny_model, load_model_dir, save_model_dir, tiny_config
from engine.topics import Names
from streams.weights import SAFETENSORS_INDEX, IncompleteModelDir, WeightPublisher, WeightSubscriber, check_hf_dir


class MemoryNats:
    """Object store and KV in a dict: the surface of streams.nats.Nats that streams/weights.py uses."""

    def __init__(self) -> None:
        from engine.config import NatsConfig

        self.cfg = NatsConfig()  # the bucket names publisher and subscriber read
        self.objects: dict[tuple[str, str], bytes] = {}
        self.kv: dict[tuple[str, str], bytes] = {}

    async def put_file(self, bucket: str, name: str, path: str | Path, timeout_s: float | None = None) -> dict[str, Any]:
        data = Path(path).read_bytes()
        self.objects[bucket, name] = data
        return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    async def get_file(self, bucket: str, name: str, path: str | Path, *, sha256: str | None = None,
                       timeout_s: float | None = None) -> int:
        data = self.objects[bucket, name]
        assert sha256 is None or hashlib.sha256(data).hexdigest() == sha256
        Path(path).write_bytes(data)
        return len(data)

    async def delete_object(self, bucket: str, name: str) -> None:
        self.objects.pop((bucket, name), None)

    async def kv_put(self, bucket: str, key: str, value: bytes) -> int:
        self.kv[bucket, key] = value
        return 1

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        return self.kv.get((bucket, key))


def _trained_model(seed: int = 5) -> tuple[Any, Any]:
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tiny_config(len(tokenizer)), seed=seed), tokenizer


async def _round_trip(src: Path, dest: Path, version: int = 1) -> Path:
    nats = MemoryNats()
    names = Names("t")
    files: list[str | Path] = sorted(p for p in src.iterdir() if p.is_file())
    await WeightPublisher(nats, names).publish(version, files)  # type: ignore[arg-type]
    manifest = await WeightPublisher(nats, names).latest()  # type: ignore[arg-type]
    assert manifest is not None and manifest.version == version
    return await WeightSubscriber(nats, names, dest).fetch(manifest)  # type: ignore[arg-type]


def _sglang_weight_iterator(path: Path) -> dict[str, torch.Tensor]:
    """What SGLang's DefaultModelLoader reads for /update_weights_from_disk: the ``*.safetensors`` files
    (only those the index names, when there is one), tensors by their Hugging Face names."""
    index = path / SAFETENSORS_INDEX
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                out[key] = st.get_tensor(key)
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("shard", [None, "200KB"])
async def test_the_learners_directory_survives_publish_and_fetch_complete_and_loadable(tmp_path: Path, shard: str | None) -> None:
    model, tokenizer = _trained_model()
    src = tmp_path / "published"
    if shard is None:
        save_model_dir(model, tokenizer, src)  # what LearnerActor._publish writes
    else:  # a model large enough to be sharded: the index and every shard travel
        model.save_pretrained(src, safe_serialization=True, max_shard_size=shard)
        tokenizer.save_pretrained(src)
        assert (src / SAFETENSORS_INDEX).exists() and len(list(src.glob("*.safetensors"))) > 1
    vdir = await _round_trip(src, tmp_path / "fetched")

    assert vdir == tmp_path / "fetched" / "v1"
    check_hf_dir(vdir)
    names = {p.name for p in vdir.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    # SGLang's loader view: every parameter of the architecture, by name and shape, and nothing else
    tensors = _sglang_weight_iterator(vdir)
    state = model.state_dict()
    assert set(tensors) == set(state)
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    # and a fresh start from the directory (SGLang --model-path, the local server) gives the same model
    loaded, loaded_tok = load_model_dir(vdir)
    ids = torch.tensor([loaded_tok.encode("12+30=")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


@pytest.mark.anyio
async def test_a_version_without_config_or_tokenizer_is_refused_naming_the_files(tmp_path: Path) -> None:
    model, _ = _trained_model()
    src = tmp_path / "bare"
    model.save_pretrained(src, safe_serialization=True)
    (src / "config.json").unlink()
    with pytest.raises(IncompleteModelDir) as info:
        await _round_trip(src, tmp_path / "fetched")
    message = str(info.value)
    assert "config.json" in message and "tokenizer_config.json" in message and "tokenizer.json" in message
    assert str(tmp_path / "fetched" / "v1") in message


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    model, tokenizer = _trained_model()
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="200KB")
    tokenizer.save_pretrained(tmp_path)
    check_hf_dir(tmp_path)
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(IncompleteModelDir, match=f"{shard.name} \\(named by {SAFETENSORS_INDEX}\\)"):
        check_hf_dir(tmp_path)
    (tmp_path / SAFETENSORS_INDEX).write_text("{}")
    with pytest.raises(IncompleteModelDir, match="weight_map"):
        check_hf_dir(tmp_path)


def test_no_weights_at_all_is_named(tmp_path: Path) -> None:
    _, tokenizer = _trained_model()
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(IncompleteModelDir, match="missing model.safetensors"):
        check_hf_dir(tmp_path)
