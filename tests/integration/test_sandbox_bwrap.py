"""Adversarial suite for the sandbox backends: every attack stays inside, and the next sandbox is clean.

Each attack runs against bwrap and against docker (a real engine, the ``docker_engine`` fixture); the
tests that look at bwrap's own machinery (cgroups it creates, owner files) are bwrap's only.
"""

from __future__ import annotations

import os
import resource
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from helpers.fixtures import process_state
from sandboxes import Limits, Sandbox, SandboxPool, open_sandbox
from sandboxes.verifiers import verify_code, verify_terminal

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def leftover_processes(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (nothing a sandbox started may survive it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found


@pytest.fixture(params=["bwrap", "docker"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return str(request.param)


@pytest.fixture
async def pool(backend: str) -> AsyncIterator[SandboxPool]:
    async with SandboxPool(backend, Limits(memory_mb=128, pids=32, timeout_s=10), size=2, max_size=4) as p:
        yield p


def _pids(sb: Sandbox) -> set[int]:
    """Host pids of every process of the sandbox, its init included."""
    if sb.__class__.__name__ == "DockerSandbox":
        return sb.host_pids()  # type: ignore[attr-defined]
    return set(sb.cgroups.pids())  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_fork_bomb_is_contained_and_next_sandbox_works(pool: SandboxPool) -> None:
    async with pool.acquire() as sb:
        result = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout=3)
        # the pids limit held (dash: "Cannot fork", busybox sh: "can't fork")
        assert "cannot fork" in result.stderr.lower().replace("can't", "cannot") or result.timed_out
        assert _pids(sb) <= sb.init_pids  # type: ignore[attr-defined]  # only the init (and bwrap)
    async with pool.acquire() as sb:
        assert (await sb.exec("echo alive")).stdout == "alive\n"


@pytest.mark.anyio
async def test_memory_bomb_is_oom_killed(backend: str) -> None:
    async with open_sandbox(backend, Limits(memory_mb=64)) as sb:
        result = await sb.exec(["python3", "-c", "x = bytearray(512 << 20); x[::4096] = b'x' * (len(x) // 4096)"])
        assert result.oom_killed and not result.timed_out
        assert result.exit_code == 137


@pytest.mark.anyio
async def test_cpu_spin_times_out_promptly(backend: str) -> None:
    async with open_sandbox(backend, Limits()) as sb:
        result = await sb.exec(["python3", "-c", "while True: pass"], timeout=1.0)
        assert result.timed_out and not result.oom_killed
        assert result.duration_s < 3.0


@pytest.mark.anyio
async def test_background_children_die_at_timeout_and_at_exit(backend: str) -> None:
    marker = f"sbxmark{uuid.uuid4().hex[:8]}"
    async with open_sandbox(backend, Limits()) as sb:
        await sb.write_files({"m.sh": f"exec sleep 300 # {marker}\n"})
        result = await sb.exec("setsid sh m.sh & nohup sh m.sh >/dev/null 2>&1 & sh m.sh", timeout=1)
        assert result.timed_out
        assert leftover_processes(marker) == []
        result = await sb.exec("setsid sh m.sh & nohup sh m.sh >/dev/null 2>&1 & echo started")
        assert result.stdout == "started\n" and not result.timed_out
        assert leftover_processes(marker) == []


@pytest.mark.anyio
async def test_zombies_do_not_accumulate(backend: str) -> None:
    async with open_sandbox(backend, Limits(pids=32)) as sb:
        script = "import os\nfor _ in range(200):\n    pid = os.fork()\n    if pid == 0: os._exit(0)\nprint('ok')\n"
        for _ in range(3):
            result = await sb.exec(["python3", "-c", script])
            assert result.stdout.strip() == "ok" or result.exit_code != 0
        assert (await sb.exec("echo fine")).stdout == "fine\n"
        assert [pid for pid in _pids(sb) if process_state(pid) == "Z"] == []
        # this sandbox's host uids (scoped: orphans of other sandboxes' owners, e.g. a host killed by
        # another test, are not this sandbox's to reap)
        uids = {_uid(str(pid)) for pid in _pids(sb)} - {-1, 0}
    if backend == "bwrap":  # docker's init runs as root; its commands' zombies were checked above
        assert uids and all(uid >= 200_000 for uid in uids)
    zombies = [p for p in os.listdir("/proc") if p.isdigit() and process_state(p) == "Z" and _uid(p) in uids]
    assert zombies == []


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


@pytest.mark.anyio
async def test_stdout_flood_is_truncated_with_bounded_memory(backend: str) -> None:
    async with open_sandbox(backend, Limits(output_bytes=1 << 20)) as sb:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = await sb.exec("head -c 1000000000 /dev/zero", timeout=60)
        grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert result.truncated and len(result.stdout) == 1 << 20
        assert result.exit_code == 0 and not result.timed_out
        assert grown_kb < 64 * 1024


@pytest.mark.anyio
async def test_no_network_egress(backend: str) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        async with open_sandbox(backend, Limits()) as sb:
            code = (
                "import socket\n"
                "def attempt(f):\n"
                "    try: f(); return 'OPEN'\n"
                "    except OSError: return 'blocked'\n"
                f"print(attempt(lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2)))\n"
                "print(attempt(lambda: socket.create_connection(('1.1.1.1', 53), timeout=2)))\n"
                "print(attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))))\n"
                "print(attempt(lambda: socket.getaddrinfo('pypi.org', 443)))\n"
            )
            result = await sb.exec(["python3", "-c", code])
            assert result.stdout.split() == ["blocked"] * 4, result
    finally:
        listener.close()


@pytest.mark.anyio
async def test_filesystem_and_secrets_are_out_of_reach(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_TEST_SECRET", "s3cr3t-value")
    async with open_sandbox(backend, Limits()) as sb:
        for cmd in ("echo x > /usr/evil", "echo x > /etc/passwd", "touch /evil", "cat /etc/shadow", "ls /root"):
            assert (await sb.exec(cmd)).exit_code != 0, cmd
        result = await sb.exec("env; cat /proc/1/environ")
        assert "s3cr3t-value" not in result.stdout + result.stderr
        assert (await sb.exec("echo ok > /work/f && cat /work/f")).stdout == "ok\n"


@pytest.mark.anyio
async def test_seccomp_refuses_namespace_and_ptrace_calls(backend: str) -> None:
    async with open_sandbox(backend, Limits()) as sb:
        code = (
            "import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), ctypes.get_errno())\n"
            "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"
            "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        )
        result = await sb.exec(["python3", "-c", code])
        assert result.stdout.split() == ["-1", "1"] * 3, result


@pytest.mark.anyio
async def test_rm_rf_then_reset_gives_a_pristine_sandbox(pool: SandboxPool) -> None:
    async with pool.acquire() as sb:
        await sb.write_files({"keep.txt": "x"})
        await sb.exec("rm -rf / 2>/dev/null; export LEAK=1; echo x > /tmp/t")
        await sb.reset()
        result = await sb.exec("ls -A /work /tmp; echo ${LEAK:-none}; python3 -c 'print(7)'")
        assert result.stdout.split() == ["/tmp:", "/work:", "none", "7"] or result.stdout.split() == [
            "/work:", "/tmp:", "none", "7"
        ]


@pytest.mark.anyio
async def test_two_sandboxes_bind_the_same_port(backend: str) -> None:
    code = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 8080)); s.listen(); print('bound')"
    async with open_sandbox(backend) as a, open_sandbox(backend) as b:
        r1, r2 = await a.exec(["python3", "-c", code]), await b.exec(["python3", "-c", code])
        assert (r1.stdout, r2.stdout) == ("bound\n", "bound\n")


TESTS = {"tests": [{"name": "t1", "code": "from solution import f\nassert f(2) == 4"},
                   {"name": "t2", "code": "from solution import f\nassert f(3) == 6"}], "timeout_s": 5}


@pytest.mark.anyio
async def test_code_verifier_scores_a_correct_program(pool: SandboxPool) -> None:
    facts = await verify_code("```python\ndef f(x):\n    return 2 * x\n```", TESTS, pool)
    assert (facts["passed"], facts["total"]) == (2, 2)
    wrong = await verify_code("def f(x):\n    return x + 1\n", TESTS, pool)
    assert wrong["passed"] == 0


@pytest.mark.parametrize(
    "hack",
    [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "import shutil, os\nfor p in ('/verify/tests', '/verify'):\n    shutil.rmtree(p, ignore_errors=True)\ndef f(x): return 0\n",
        "import os\nopen('/work/result.json', 'w').write('{\"passed\": 2}')\nprint('PASSED')\ndef f(x): return 0\n",
        "import os, sys\nos._exit = lambda c: None\nsys.exit = lambda c=0: None\ndef f(x): return 0\n",
        "import builtins, sys\nprint(sys.stdin.read())\nimport atexit\natexit.register(lambda: print('ok'))\ndef f(x): return 0\n",
        "import os\ntry:\n    open('/verify/tests/test_0.py', 'w').write('pass')\nexcept OSError: pass\ndef f(x): return 0\n",
    ],
)
@pytest.mark.anyio
async def test_code_verifier_resists_reward_hacking(pool: SandboxPool, hack: str) -> None:
    facts = await verify_code(hack, TESTS, pool)
    assert facts["passed"] == 0, facts


@pytest.mark.anyio
async def test_terminal_episode_keeps_state_between_turns(pool: SandboxPool) -> None:
    spec = {
        "setup_files": {"in.txt": "hello world\n"},
        "checks": [{"cmd": "grep -q hello /work/sub/out.txt"}, {"cmd": "test -f /work/missing"}],
        "max_turns": 4,
    }
    completion = "```bash\nmkdir sub && cd sub\n```\n```bash\nexport SRC=/work/in.txt\n```\n```bash\ncp $SRC out.txt\n```"
    facts = await verify_terminal(completion, spec, pool)
    assert facts == {"checks_passed": 1, "checks_total": 2, "turns": 3}


@pytest.mark.anyio
async def test_the_init_survives_attacks_from_inside(backend: str) -> None:
    async with open_sandbox(backend, Limits(memory_mb=64)) as sb:
        init_pids = sb.init_pids  # type: ignore[attr-defined]
        await sb.exec("kill -9 1; kill -9 -1; kill -STOP 1")
        code = "try:\n    open('/proc/1/mem', 'rb').read(1)\n    print('READ')\nexcept OSError:\n    print('denied')\n"
        assert (await sb.exec(["python3", "-c", code])).stdout == "denied\n"
        bomb = await sb.exec(["python3", "-c", "x = bytearray(512 << 20); x[::4096] = b'x' * (len(x) // 4096)"])
        assert bomb.oom_killed
        assert (await sb.exec("echo alive")).stdout == "alive\n"
        assert sb.init_pids == init_pids  # type: ignore[attr-defined]  # the same init all along


@pytest.mark.anyio
async def test_a_cancelled_exec_does_not_confuse_the_next_one(backend: str) -> None:
    async with open_sandbox(backend, Limits()) as sb:
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.5):
                await sb.exec("sleep 30; echo late")
        assert _pids(sb) <= sb.init_pids  # type: ignore[attr-defined]
        result = await sb.exec("echo next")
        assert (result.stdout, result.exit_code) == ("next\n", 0)


@pytest.mark.anyio
async def test_pool_closes_the_idle_surplus_of_a_burst() -> None:
    import time

    from sandboxes.bwrap import SANDBOX_ROOT

    limits = Limits(memory_mb=64, pids=16, timeout_s=10)
    async with SandboxPool("bwrap", limits, size=1, max_size=4, idle_ttl_s=30.0) as pool:
        burst = [await pool.checkout() for _ in range(4)]  # one pre-warmed, three created
        for sandbox in burst:
            await pool.release(sandbox)
        assert pool.statistics().idle == 4
        assert await pool.trim() == 0  # just used: not cold yet
        hot = burst[-1]
        assert await pool.trim(now=time.monotonic() + 31.0) == 3  # down to `size`
        stats = pool.statistics()
        assert (stats.idle, stats.in_use, stats.trimmed) == (1, 0, 3)
        gone = [sb for sb in burst if sb is not hot]
        # the last released is the one kept (handed out first); the closed ones left nothing behind
        assert not [sb.id for sb in gone if (SANDBOX_ROOT / f"{sb.id}.owner").exists()]
        async with pool.acquire() as sb:
            assert sb is hot
            assert (await sb.exec("echo ok")).stdout == "ok\n"


@pytest.mark.anyio
async def test_a_bwrap_start_past_its_timeout_is_a_sandbox_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that runs out of time (an overloaded host) is an infrastructure failure: SandboxError, which
    the sandbox actor re-delivers, not a bare TimeoutError that a verifier would score zero; nothing is left."""
    from sandboxes import SandboxError, bwrap

    monkeypatch.setattr(bwrap, "START_TIMEOUT_S", 0.0)
    created: list[bwrap.BwrapSandbox] = []
    real_init = bwrap.BwrapSandbox.__init__

    def spy(self: bwrap.BwrapSandbox, limits: Limits) -> None:
        real_init(self, limits)
        created.append(self)

    monkeypatch.setattr(bwrap.BwrapSandbox, "__init__", spy)
    with pytest.raises(SandboxError, match="within 0s"):
        await bwrap.BwrapSandbox.create(Limits())
    (sandbox,) = created
    assert not sandbox.dir.exists()  # closed: workspace, owner file and cgroups gone
    assert not (bwrap.SANDBOX_ROOT / f"{sandbox.id}.owner").exists()


def test_processes_preparing_the_sandbox_root_at_once_all_succeed() -> None:
    """Two sandbox daemons of one host start together: each prepares the shared root (its /etc files, the
    mount probe) without tripping over the other (a shared probe directory removed by one made the other
    crash with FileNotFoundError), and each still finds it can mount."""
    import subprocess
    import sys

    code = ("import sys; from sandboxes.bwrap import _Host; h = _Host(); "
            "print(h.can_mount == h.privileged, flush=True)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [err for _, err in results]
    assert [out.strip() for out, _ in results] == ["True"] * 8
    from sandboxes.bwrap import SANDBOX_ROOT

    assert not [p.name for p in SANDBOX_ROOT.iterdir() if p.name.startswith("probe")]  # no probe left behind
    assert not [p.name for p in (SANDBOX_ROOT / "etc").iterdir() if p.name.endswith(".tmp")]
