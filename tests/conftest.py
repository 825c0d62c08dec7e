"""Fixtures every test may use. Async tests run on anyio's pytest plugin with the asyncio backend
(nats-py and the Kafka clients need an asyncio loop): mark them ``@pytest.mark.anyio``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from ops.infra.process import free_port


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def tiny_local_server(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(model directory, URL) of the local server's app in this process, serving the tiny char model."""
    from aiohttp.test_utils import TestServer

    from modelserver.llm import write_tiny_model_dir
    from modelserver.local.server import ServerConfig, build_app

    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    server = TestServer(build_app(ServerConfig(model_dir=model_dir, max_batch=8, chunk_size=64)), port=0)
    await server.start_server()
    try:
        yield model_dir, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
def free_tcp_port() -> Callable[[], int]:
    """Call to get a currently unused TCP port on 127.0.0.1."""
    return free_port


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate!r}")
        time.sleep(interval_s)


@pytest.fixture
def wait_until() -> Callable[..., None]:
    """``wait_until(predicate, timeout_s=10, what="...")``: poll a sync condition, fail on timeout."""
    return _wait_until


@pytest.fixture(scope="session")
def real_model_dir():
    """The prepared SmolLM2-135M-Instruct directory (``$ROLLOUT_MODEL_DIR`` or the model cache).

    A machine without it fails the test with the command that prepares it (ops/bootstrap.sh runs it);
    it is never skipped. Treat the directory as read-only: build variants in tmp_path with symlinks.
    """
    from modelserver.prepare import ModelNotPrepared, require_model_dir

    try:
        return require_model_dir("smollm2-135m")
    except ModelNotPrepared as exc:
        pytest.fail(str(exc), pytrace=False)
