"""The docker backend against a real Docker engine: exec, limits, no network, read-only root, reset."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sandboxes import Limits, Sandbox, SandboxPool, open_sandbox

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def sandbox(docker_engine: object) -> AsyncIterator[Sandbox]:
    async with open_sandbox("docker", Limits(memory_mb=64, pids=16, timeout_s=10)) as sb:
        yield sb


@pytest.mark.anyio
async def test_exec_stdin_files_and_exit_codes(sandbox: Sandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.timed_out and not result.oom_killed
    await sandbox.write_files({"d/a.py": "import sys; print(sys.stdin.read().upper())"})
    result = await sandbox.exec(["python3", "d/a.py"], stdin=b"hello")
    assert result.stdout == "HELLO\n", result
    assert await sandbox.read_file("d/a.py") == b"import sys; print(sys.stdin.read().upper())"
    assert (await sandbox.exec("id -u")).stdout.strip() == "65534"


@pytest.mark.anyio
async def test_memory_bomb_is_oom_killed(sandbox: Sandbox) -> None:
    result = await sandbox.exec(["python3", "-c", "x = bytearray(512 << 20); x[::4096] = b'x' * (len(x) // 4096)"])
    assert result.oom_killed and not result.timed_out, result
    assert (await sandbox.exec("echo alive")).stdout == "alive\n"


@pytest.mark.anyio
async def test_pids_limit_contains_a_fork_bomb(sandbox: Sandbox) -> None:
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
            "            time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n")
    result = await sandbox.exec(["python3", "-c", code], timeout=8)
    assert int(result.stdout.split()[0]) < 16, result


@pytest.mark.anyio
async def test_timeout_kills_the_command(sandbox: Sandbox) -> None:
    result = await sandbox.exec("sleep 60", timeout=1)
    assert result.timed_out and result.duration_s < 10
    assert (await sandbox.exec("ps -o args | grep -c '[s]leep 60' || true")).stdout.strip() == "0"


@pytest.mark.anyio
async def test_network_none_blocks_egress(sandbox: Sandbox) -> None:
    code = (
        "import socket\n"
        "def attempt(f):\n"
        "    try: f(); return 'OPEN'\n"
        "    except OSError: return 'blocked'\n"
        "print(attempt(lambda: socket.create_connection(('1.1.1.1', 53), timeout=2)))\n"
        "print(attempt(lambda: socket.getaddrinfo('pypi.org', 443)))\n"
    )
    result = await sandbox.exec(["python3", "-c", code])
    assert result.stdout.split() == ["blocked", "blocked"], result


@pytest.mark.anyio
async def test_root_is_read_only(sandbox: Sandbox) -> None:
    for cmd in ("touch /evil", "echo x > /usr/evil", "echo x > /etc/passwd"):
        assert (await sandbox.exec(cmd)).exit_code != 0, cmd
    assert (await sandbox.exec("echo ok > /work/f && cat /work/f")).stdout == "ok\n"


@pytest.mark.anyio
async def test_reset_gives_a_pristine_sandbox(docker_engine: object) -> None:
    async with SandboxPool("docker", Limits(memory_mb=64, pids=16), size=1, max_size=1) as pool:
        async with pool.acquire() as sb:
            await sb.write_files({"keep.txt": "x"})
            await sb.exec("echo x > /tmp/t; sleep 300 >/dev/null 2>&1 &")
        async with pool.acquire() as sb:
            result = await sb.exec("ls -A /work /tmp; ps -o args | grep -c '[s]leep 300' || true")
            assert "keep.txt" not in result.stdout and "t\n" not in result.stdout.split("/tmp:")[1], result
            assert result.stdout.split()[-1] == "0"
