"""Inference backends are looked up by name: the config accepts exactly the registered ones, and a
backend that starts no server of its own must be given URLs (and its model directory if it says so)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from modelserver.backends import (inference_backend, inference_backend_names, register_inference_backend,
                                       unregister_inference_backend)
from modelserver.launch import LocalServer
from engine.config import ConfigError, InferenceConfig, load_config


@contextlib.asynccontextmanager
async def fake_launch(cfg: InferenceConfig, model_dir: Path, run_dir: Path) -> AsyncIterator[str]:
    yield "http://127.0.0.1:1"


@pytest.fixture
def registered() -> Iterator[None]:
    register_inference_backend("launching_test", fake_launch)
    register_inference_backend("external_test", None, needs_model_dir=True)
    try:
        yield
    finally:
        unregister_inference_backend("launching_test")
        unregister_inference_backend("external_test")


def test_builtin_backends_are_registered() -> None:
    assert {"local", "sglang"} <= set(inference_backend_names())
    local = inference_backend("local").launch
    assert local is not None
    server = local(InferenceConfig(), Path("/models/m"), Path("/runs/r"))
    assert isinstance(server, LocalServer) and server.log_path == Path("/runs/r/logs/inference-server.log")
    assert inference_backend("sglang").launch is None and inference_backend("sglang").needs_model_dir


def test_config_accepts_only_registered_backends(registered: None) -> None:
    assert InferenceConfig(backend="launching_test").backend == "launching_test"
    with pytest.raises(ValidationError, match=r"unknown inference backend 'nope'.*launching_test"):
        InferenceConfig(backend="nope")


def test_an_external_backend_needs_urls_and_model_dir(registered: None) -> None:
    with pytest.raises(ValidationError, match="backend 'external_test' needs the URLs"):
        InferenceConfig(backend="external_test", model_dir="/m")
    with pytest.raises(ValidationError, match="backend 'external_test' needs the model directory"):
        InferenceConfig(backend="external_test", urls=["http://h:1"])
    cfg = InferenceConfig(backend="external_test", urls=["http://h:1"], model_dir="/m")
    assert cfg.urls == ["http://h:1"]


def test_registration_refuses_duplicates_and_bad_names(registered: None) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_inference_backend("local", fake_launch)
    with pytest.raises(ValueError, match="use letters"):
        register_inference_backend("bad name", fake_launch)
    with pytest.raises(TypeError, match="launch must be callable"):
        register_inference_backend("x_test", "not callable")  # type: ignore[arg-type]


def test_a_config_file_naming_unknown_backends_says_which_file_and_fields(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text('[sandbox]\nbackend = "firecracker"\n[inference]\nbackend = "simx"\n')
    with pytest.raises(ConfigError) as err:
        load_config(f)
    message = str(err.value)
    assert f"{f}: inference.backend: unknown inference backend 'simx'; expected one of ('local', 'sglang'" in message
    assert f"{f}: sandbox.backend: unknown sandbox backend 'firecracker'; expected one of ('bwrap', 'docker'" in message
