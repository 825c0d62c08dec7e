"""Weight versions end to end: a bf16 version through NATS into a float32 server, and a weight update
applied on the real model while a request decodes (it finishes, its tokens tagged with both versions).

The real model (SmolLM2-135M-Instruct) is found through ``ROLLOUT_MODEL_DIR`` or the model cache
(``rollout model prepare smollm2-135m``); a missing model fails the test with what to run.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file

from modelserver.local.engine import LocalEngine, Sequence
from modelserver.local.protocol import SamplingParams
from actors.learner import save_weights
from modelserver.llm import build_tiny_model, load_model_dir, tiny_config, write_tiny_model_dir
from engine.config import NatsConfig
from engine.topics import Names
from streams.nats import Nats
from streams.weights import WeightPublisher, WeightSubscriber, safetensors_header

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def real_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct directory; fails (never skips) when there is none."""
    found = os.environ.get("ROLLOUT_MODEL_DIR")
    if not found:
        try:
            from modelserver.prepare import cached_model_dir  # type: ignore[import-not-found]
        except ImportError:
            cached_model_dir = None
        if cached_model_dir is not None:
            found = str(cached_model_dir("smollm2-135m"))
    if not found or not (Path(found) / "config.json").is_file():
        pytest.fail(f"no prepared SmolLM2-135M-Instruct directory (ROLLOUT_MODEL_DIR={found!r}); "
                    "run `rollout model prepare smollm2-135m` or set ROLLOUT_MODEL_DIR")
    return Path(found)


async def _finished(seq: Sequence) -> Sequence:
    while not seq.finished:
        await seq.wait_changed()
    return seq


async def test_a_bf16_version_goes_through_nats_as_is_and_a_float32_server_casts_it(
        nats_url: str, unique_name: str, tmp_path: Path) -> None:
    served, tokenizer = load_model_dir(write_tiny_model_dir(tmp_path / "model", seed=0))
    trained = build_tiny_model(tiny_config(len(tokenizer)), seed=1)  # the learner's next weights
    files = save_weights(trained, tmp_path / "published", "bfloat16", tokenizer)
    names = Names(unique_name)
    async with Nats(NatsConfig(url=nats_url, timeout_s=30)) as n:
        manifest = await WeightPublisher(n, names).publish(1, files)
        assert manifest.wire_dtype == "bfloat16"
        assert {t["dtype"] for t in manifest.tensors.values()} == {"BF16"}
        sub = WeightSubscriber(n, names, tmp_path / "fetched", timeout_s=60)
        with anyio.fail_after(60):
            async for announced in sub.manifests():
                break
        assert announced == manifest
        vdir = await sub.fetch(announced)
    # the subscriber writes the objects as they are: byte for byte the learner's files
    for f in files:
        assert (vdir / Path(f).name).read_bytes() == Path(f).read_bytes()
    assert {t["dtype"] for t in safetensors_header(vdir / "model.safetensors").values()} == {"BF16"}

    engine = LocalEngine(served, tokenizer)
    await engine.start()
    try:
        assert await engine.update_weights_from_disk(str(vdir), weight_version="1") == 0
        seq = engine.submit(tokenizer.encode("3+4="), SamplingParams(max_new_tokens=4, temperature=0))
        with anyio.fail_after(60):
            await _finished(seq)
    finally:
        await engine.aclose()
    assert seq.token_versions == ["1"] * 4
    for name, p in served.state_dict().items():
        assert p.dtype == torch.float32  # served in its own dtype, holding the bf16-rounded values
        assert torch.equal(p, trained.state_dict()[name].to(torch.bfloat16).to(torch.float32)), name


async def test_a_weight_update_mid_generation_on_the_real_model_keeps_the_request(tmp_path: Path) -> None:
    model, tokenizer = load_model_dir(real_model_dir())
    original = {k: v.clone() for k, v in model.state_dict().items()}
    # version "v1": the same weights as the learner publishes them in bf16 (a real, 270 MB checkpoint)
    save_weights(model, tmp_path / "v1", "bfloat16")
    assert (tmp_path / "v1" / "model.safetensors").stat().st_size < 0.55 * sum(
        v.numel() * 4 for k, v in original.items() if k != "lm_head.weight")
    engine = LocalEngine(model, tokenizer, max_batch=4)
    await engine.start()
    try:
        prompt = tokenizer.encode("Write the numbers from one to one hundred in words, separated by commas:")
        seq = engine.submit(prompt, SamplingParams(max_new_tokens=48, temperature=1.0, ignore_eos=True,
                                                   sampling_seed=7))
        with anyio.fail_after(120):
            while len(seq.output_ids) < 4:
                await seq.wait_changed()
            assert not seq.finished
            in_flight = await engine.update_weights_from_disk(str(tmp_path / "v1"), weight_version="v1")
            await _finished(seq)
    finally:
        await engine.aclose()
    assert in_flight == 1
    assert seq.finish_reason == {"type": "length", "length": 48}
    assert len(seq.output_ids) == len(seq.logprobs) == len(seq.token_versions) == 48
    switched = seq.token_versions.index("v1")
    # every token before the swap is of the old version, every one after it of the new: none dropped
    assert 4 <= switched < 48
    assert seq.token_versions == ["default"] * switched + ["v1"] * (48 - switched)
    assert seq.weight_version == "v1"
    saved = load_file(str(tmp_path / "v1" / "model.safetensors"))
    for name, p in model.state_dict().items():
        assert p.dtype == torch.float32
        assert torch.equal(p, original[name].to(torch.bfloat16).to(torch.float32)), name
    assert saved["model.embed_tokens.weight"].dtype == torch.bfloat16
