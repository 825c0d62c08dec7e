"""A sandbox backend registered from outside the package, in one call, runs real verifications.

``marked`` is a thin backend over bubblewrap whose every command sees ``SANDBOX_MARK=marked``. It is
registered here with one :func:`register_sandbox_backend` call; the config names it, the shared pool
of the sandbox actors opens its sandboxes through the registry, and the built-in code verifier runs
tests in them (the tests assert the marker, so they pass only inside this backend's sandboxes).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from actors.sandbox import SandboxResources
from engine.config import ConfigError, EngineConfig, SandboxConfig
from ops.deployment import backend_errors, check_backends
from sandboxes import (ExecResult, Limits, open_sandbox, register_sandbox_backend, sandbox_backend_names,
                       unregister_sandbox_backend)
from sandboxes.bwrap import BwrapSandbox
from sandboxes.verifiers import verify_code
from tests.unit.test_extending_doc import run_snippet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NAME = "marked_test"
CREATED: list[BwrapSandbox] = []


class MarkedSandbox(BwrapSandbox):
    """A bubblewrap sandbox whose commands carry a marker in their environment."""

    async def exec(self, cmd: str | list[str], stdin: bytes | None = None, timeout: float | None = None,
                   env: dict[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        return await super().exec(cmd, stdin=stdin, timeout=timeout, env={**(env or {}), "SANDBOX_MARK": "marked"},
                                  cwd=cwd)


async def create_marked(limits: Limits) -> MarkedSandbox:
    sandbox = await MarkedSandbox.create(limits)
    CREATED.append(sandbox)
    return sandbox


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def marked_backend() -> Iterator[str]:
    register_sandbox_backend(NAME, create_marked, description="bwrap with SANDBOX_MARK=marked")
    CREATED.clear()
    try:
        yield NAME
    finally:
        unregister_sandbox_backend(NAME)


TESTS = [{"name": "adds", "code": "from solution import f\nassert f(2) == 4\n"},
         {"name": "inside the marked backend",
          "code": "import os\nassert os.environ.get('SANDBOX_MARK') == 'marked', os.environ.get('SANDBOX_MARK')\n"}]


def test_config_accepts_only_registered_backends(marked_backend: str) -> None:
    assert {"bwrap", "docker", NAME} <= set(sandbox_backend_names())
    assert backend_errors(EngineConfig(sandbox=SandboxConfig(backend=NAME))) == []
    with pytest.raises(ConfigError, match=r"sandbox.*'nope'.*expected one of.*marked_test"):
        check_backends(EngineConfig(sandbox=SandboxConfig(backend="nope")))


def test_an_unregistered_backend_is_unknown_again(marked_backend: str) -> None:
    unregister_sandbox_backend(NAME)
    with pytest.raises(ConfigError, match="marked_test"):
        check_backends(EngineConfig(sandbox=SandboxConfig(backend=NAME)))


@pytest.mark.anyio
async def test_a_backend_registered_once_runs_verifications(marked_backend: str) -> None:
    cfg = SandboxConfig(backend=NAME, pool_size=1, max_sandboxes=2, memory_mb=128, pids=32, timeout_s=5)
    async with SandboxResources(cfg) as resources:
        good = await verify_code("def f(x):\n    return 2 * x\n", {"tests": TESTS}, resources.pool)
        bad = await verify_code("def f(x):\n    return x + 1\n", {"tests": TESTS}, resources.pool)
        assert resources.pool_statistics()["created"] == len(CREATED) >= 1  # type: ignore[index]
    assert (good["passed"], good["total"]) == (2, 2), good
    assert [t["passed"] for t in bad["tests"]] == [False, True], bad
    assert all(type(sb) is MarkedSandbox for sb in CREATED)


@pytest.mark.anyio
async def test_the_same_tests_fail_outside_the_marked_backend() -> None:
    """The marker test is not vacuous: in a plain bwrap sandbox it fails."""
    cfg = SandboxConfig(backend="bwrap", pool_size=1, max_sandboxes=1, memory_mb=128, pids=32, timeout_s=5)
    async with SandboxResources(cfg) as resources:
        facts = await verify_code("def f(x):\n    return 2 * x\n", {"tests": TESTS}, resources.pool)
    assert [t["passed"] for t in facts["tests"]] == [True, False], facts


@pytest.mark.anyio
async def test_the_documented_backend_runs_commands() -> None:
    """docs/extending.md's backend, executed as written, opens real sandboxes with the seed fixed."""
    run_snippet("A new sandbox backend")
    try:
        async with open_sandbox("bwrap_seeded", Limits(memory_mb=128, pids=32)) as sandbox:
            seeded = await sandbox.exec(["/usr/bin/python3", "-c", "import os; print(os.environ['PYTHONHASHSEED'])"])
            chosen = await sandbox.exec("echo $PYTHONHASHSEED", env={"PYTHONHASHSEED": "7"})
    finally:
        unregister_sandbox_backend("bwrap_seeded")
    assert (seeded.exit_code, seeded.stdout.strip()) == (0, "0"), seeded
    assert chosen.stdout.strip() == "7"  # the caller's environment still wins
