"""The docker backend against a real Docker engine: exec, limits, no network, read-only root, ptrace
refused, reset in place. The attack suite (tests/integration/test_sandbox_bwrap.py) runs on docker too."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import anyio
import pytest

from helpers.fixtures import process_state
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
async def test_ptrace_is_refused(sandbox: Sandbox) -> None:
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"  # PTRACE_TRACEME
            "import os\npid = os.fork()\nif pid == 0:\n    import time; time.sleep(5); os._exit(0)\n"
            "print(libc.ptrace(16, pid, 0, 0), ctypes.get_errno())\n")  # PTRACE_ATTACH to its own child
    result = await sandbox.exec(["python3", "-c", code])
    assert result.stdout.split() == ["-1", "1", "-1", "1"], result  # EPERM, as under bwrap


EPISODE = """
set -e
echo secret > /work/w.txt; mkdir -p /work/d/e; echo x > /work/d/e/f; chmod 000 /work/d; chmod 777 /work
echo x > /tmp/t; mkdir /tmp/.hidden; echo y > /dev/shm/s
python3 - <<'PY'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0x5eed, 4096, 0o1600) >= 0      # IPC_CREAT | 0600: a System V segment
assert libc.semget(0x5eed, 1, 0o1600) >= 0
assert libc.msgget(0x5eed, 0o1600) >= 0
fd = os.open("/dev/mqueue/q", os.O_CREAT | os.O_RDWR, 0o600) if os.path.isdir("/dev/mqueue") else -1
PY
export LEAK=1
sleep 300 >/dev/null 2>&1 &
python3 -c "import os; os.fork() and os._exit(0); os.setsid(); os.execvp('sleep', ['sleep', '301'])" >/dev/null 2>&1
python3 - <<'PY'
import glob, time
def sleeping():  # both background jobs run (the second left its session) before this exec ends
    n = 0
    for path in glob.glob("/proc/[0-9]*/comm"):
        try:
            n += open(path).read().strip() == "sleep"
        except OSError:
            pass
    return n
end = time.monotonic() + 5
while sleeping() < 2 and time.monotonic() < end:
    time.sleep(0.01)
assert sleeping() == 2, sleeping()
PY
"""

# The last line counts the episode's background sleeps by their comm: a `ps` listing would race with
# this script's own pipeline members, whose argv is empty for an instant while they exec.
INSPECT = """
ls -A /work /tmp /verify /dev/shm; ls -A /dev/mqueue 2>/dev/null
stat -c '%a %u' /work
cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg | grep -c -w 24301 || true  # key 0x5eed
echo "LEAK=${LEAK:-none}"
cat /proc/[0-9]*/comm 2>/dev/null | grep -c -x sleep || true
"""


@pytest.mark.anyio
async def test_reset_in_place_leaves_nothing_of_the_episode(docker_engine: object) -> None:
    async with open_sandbox("docker", Limits(memory_mb=64, pids=32, timeout_s=10)) as sb:
        container, init = sb.container.id, sb.init_pids  # type: ignore[attr-defined]
        pristine = await sb.exec(INSPECT)
        await sb.write_protected_files({"tests/t.py": "assert True"})
        episode = await sb.exec(EPISODE)
        assert episode.exit_code == 0, episode
        dirty = await sb.exec(INSPECT)
        assert {"w.txt", "d", "t", ".hidden", "s", "tests"} <= set(dirty.stdout.split()), dirty
        assert dirty.stdout.split()[-5:] == ["777", "65534", "3", "LEAK=none", "0"], dirty
        assert sb.host_pids() == set(init)  # type: ignore[attr-defined]  # background jobs end with their exec
        await sb.reset()
        after = await sb.exec(INSPECT)
        assert after.stdout == pristine.stdout, (pristine.stdout, after.stdout)
        assert after.stdout.split()[-6:] == ["/work:", "700", "65534", "0", "LEAK=none", "0"], after
        # the same container and init: the reset was done inside, not by starting a new container
        assert (sb.container.id, sb.init_pids) == (container, init)  # type: ignore[attr-defined]


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


@pytest.mark.anyio
async def test_a_dead_init_is_replaced_at_reset(sandbox: Sandbox) -> None:
    old = sandbox.container.id  # type: ignore[attr-defined]
    await sandbox.write_files({"old.txt": "x"})
    (init,) = sandbox.init_pids  # type: ignore[attr-defined]
    os.kill(init, signal.SIGKILL)  # the container ends with its pid 1
    with anyio.fail_after(10):
        while process_state(init) not in ("", "Z"):
            await anyio.sleep(0.01)
    await sandbox.reset()
    assert sandbox.container.id != old  # type: ignore[attr-defined]
    result = await sandbox.exec("ls -A /work; echo back")
    assert result.stdout == "back\n", result
