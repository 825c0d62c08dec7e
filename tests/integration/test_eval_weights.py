"""`rollout eval --weights CONFIG` on the real nats-server: the latest published version, over the model
directory's config and tokenizer, is what gets served; a namespace with nothing published is a clear error."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modelserver.llm import load_model_dir, save_model_dir, write_tiny_model_dir
from engine.config import NatsConfig
from engine.topics import Names
from ops.cli_eval import PolicyError, policy_dir
from streams.nats import Nats
from streams.weights import WeightPublisher

pytestmark = pytest.mark.anyio


def _config(path: Path, namespace: str, nats_url: str, model_dir: Path) -> str:
    path.write_text(f'namespace = "{namespace}"\n[nats]\nurl = "{nats_url}"\n[inference]\nmodel_dir = "{model_dir}"\n')
    return str(path)


async def test_weights_serves_the_latest_published_version(nats_url: str, unique_name: str, tmp_path: Path) -> None:
    base = write_tiny_model_dir(tmp_path / "base", seed=0)
    model, tok = load_model_dir(base)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_model_dir(model, tok, tmp_path / "v2")
    args = argparse.Namespace(checkpoint=None, model_dir=None,
                              weights=_config(tmp_path / "c.toml", unique_name, nats_url, base))

    with pytest.raises(PolicyError, match="has no published weight version"):
        await policy_dir(args, tmp_path / "scratch0")

    nats = await Nats(NatsConfig(url=nats_url)).connect()
    try:
        names = Names(unique_name)
        await WeightPublisher(nats, names).publish(1, sorted((base).iterdir()))
        await WeightPublisher(nats, names).publish(2, sorted((tmp_path / "v2").iterdir()))
    finally:
        await nats.close()
    served = await policy_dir(args, tmp_path / "scratch")
    got, want = load_file(served / "model.safetensors"), load_file(tmp_path / "v2" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (served / "tokenizer_config.json").exists() and (served / "config.json").exists()
