"""Inference backends are looked up by name: a deployment's config accepts exactly the registered ones, and
a backend that starts no server of its own must be given URLs (and its model directory if it says so).

The names are checked where the deployment is wired (ops/deployment.py), not by engine/config.py: the
engine imports no package above it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from modelserver.backends import (inference_backend, inference_backend_names, register_inference_backend,
                                  unregister_inference_backend)
from modelserver.launch import LocalServer
from engine.config import ConfigError, EngineConfig, InferenceConfig, load_config
from ops.deployment import Deployment, backend_errors, check_backends, load_deployment_config


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


def _with(**inference: object) -> EngineConfig:
    return EngineConfig(inference=InferenceConfig.model_validate(inference))


def test_config_accepts_only_registered_backends(registered: None) -> None:
    assert backend_errors(_with(backend="launching_test")) == []
    with pytest.raises(ConfigError, match=r"^inference\.backend: unknown inference backend 'nope'.*launching_test"):
        check_backends(_with(backend="nope"))


def test_an_external_backend_needs_urls_and_model_dir(registered: None) -> None:
    with pytest.raises(ConfigError, match="^inference.urls: backend 'external_test' needs the URLs"):
        check_backends(_with(backend="external_test", model_dir="/m"))
    with pytest.raises(ConfigError, match="^inference.model_dir: backend 'external_test' needs the model directory"):
        check_backends(_with(backend="external_test", urls=["http://h:1"]))
    assert [field for field, _ in backend_errors(_with(backend="external_test"))] == [
        "inference.urls", "inference.model_dir"]
    assert backend_errors(_with(backend="external_test", urls=["http://h:1"], model_dir="/m")) == []


@pytest.mark.anyio
async def test_a_deployment_built_in_code_refuses_an_unknown_backend_before_wiring(tmp_path: Path) -> None:
    cfg = EngineConfig.model_validate({"sandbox": {"backend": "firecracker"}, "roles": ["reward"]})
    deployment = Deployment(cfg, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^sandbox\.backend: unknown sandbox backend 'firecracker'; expected one of"):
        await deployment.__aenter__()
    assert not (tmp_path / "run").exists()  # refused before anything was wired


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
        load_deployment_config(f)
    message = str(err.value)
    assert f"{f}: inference.backend: unknown inference backend 'simx'; expected one of ('local', 'sglang'" in message
    assert f"{f}: sandbox.backend: unknown sandbox backend 'firecracker'; expected one of ('bwrap', 'docker'" in message
    assert load_config(f, environ={}).sandbox.backend == "firecracker"  # the engine's loader leaves the names to the deployment


def test_sglang_backend_must_name_its_model_and_servers(tmp_path: Path) -> None:
    f = tmp_path / "sglang.toml"
    f.write_text('[inference]\nbackend = "sglang"\nurls = ["http://sglang:30000"]\n')
    with pytest.raises(ConfigError) as ei:
        load_deployment_config(f, environ={})
    message = str(ei.value)
    assert message.startswith(f"{f}: inference.model_dir: backend 'sglang' needs the model directory")
    assert "Value error" not in message
    cfg = load_deployment_config(f, environ={"ROLLOUT__INFERENCE__MODEL_DIR": "/models/policy"})
    assert cfg.inference.model_dir == "/models/policy"
    f.write_text('[inference]\nbackend = "sglang"\nmodel_dir = "/models/policy"\n')
    with pytest.raises(ConfigError, match=r"sglang\.toml: inference\.urls: backend 'sglang' needs the URLs"):
        load_deployment_config(f, environ={})
    assert load_deployment_config(environ={}).inference.model_dir is None  # the local backend may build its tiny model
