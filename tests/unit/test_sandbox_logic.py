"""Pure logic of sandboxes/: output capping, answer extraction, seccomp assembly, limits."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sandboxes import seccomp
from sandboxes.base import OutputCap, normalize_path
from sandboxes.limits import Limits
from sandboxes.verifiers import answers_match, extract_answer, extract_commands, extract_program


def test_output_cap_keeps_prefix_and_counts_the_rest() -> None:
    cap = OutputCap(10)
    for _ in range(1000):
        cap.feed(b"abcdef")
    assert cap.getvalue() == b"abcdefabcd"
    assert cap.truncated and cap.dropped == 6000 - 10


def test_output_cap_exact_fit_is_not_truncated() -> None:
    cap = OutputCap(4)
    cap.feed(b"ab")
    cap.feed(b"cd")
    assert cap.getvalue() == b"abcd" and not cap.truncated


def test_output_cap_decodes_invalid_utf8_with_replacement() -> None:
    cap = OutputCap(100)
    cap.feed(b"ok \xff")
    assert cap.text() == "ok \ufffd"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so it is \\boxed{\\frac{1}{2}} ok", "\\frac{1}{2}"),
        ("first 3 then \\boxed{42}", "42"),
        ("work...\nAnswer: 17\n", "17"),
        ("there are 3 cats and 12 dogs", "12"),
        ("no numbers here", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_answers_match_numbers_by_value() -> None:
    assert answers_match("4.0", "4")
    assert answers_match("1,000", "1000")
    assert answers_match(" 1/2 ", "0.5")
    assert not answers_match("41", "42")
    assert answers_match("Paris", "paris")


def test_extract_program_prefers_last_python_block() -> None:
    text = "```python\nx = 1\n```\nbetter:\n```python\ndef f(x):\n    return 2 * x\n```"
    assert extract_program(text) == "def f(x):\n    return 2 * x\n"
    assert extract_program("def f(): pass") == "def f(): pass"


def test_extract_commands() -> None:
    assert extract_commands("```bash\necho hi > a\n```\n```bash\ncat a\n```") == ["echo hi > a", "cat a"]
    assert extract_commands("ls\n\npwd\n") == ["ls", "pwd"]


def test_seccomp_denies_listed_syscalls_and_allows_others() -> None:
    program = seccomp.build_program()
    eperm = seccomp.SECCOMP_RET_ERRNO | seccomp.EPERM
    for name, nr in seccomp.DENIED_SYSCALLS.items():
        assert seccomp.run_program(program, nr) == eperm, name
    for nr in (0, 1, 2, 9, 57, 59, 60, 231):  # read write open mmap fork execve exit exit_group
        assert seccomp.run_program(program, nr) == seccomp.SECCOMP_RET_ALLOW


def test_seccomp_argument_checks() -> None:
    program = seccomp.build_program()
    eperm = seccomp.SECCOMP_RET_ERRNO | seccomp.EPERM
    assert seccomp.run_program(program, seccomp.SYS_IOCTL, args=(0, seccomp.TIOCSTI)) == eperm
    assert seccomp.run_program(program, seccomp.SYS_IOCTL, args=(0, 0x5401)) == seccomp.SECCOMP_RET_ALLOW
    assert seccomp.run_program(program, seccomp.SYS_CLONE, args=(0x10000000,)) == eperm  # CLONE_NEWUSER
    thread_flags = 0x3D0F00
    assert seccomp.run_program(program, seccomp.SYS_CLONE, args=(thread_flags,)) == seccomp.SECCOMP_RET_ALLOW
    assert seccomp.run_program(program, seccomp.SYS_CLONE3) == seccomp.SECCOMP_RET_ERRNO | seccomp.ENOSYS


def test_seccomp_kills_foreign_arch_and_x32() -> None:
    program = seccomp.build_program()
    assert seccomp.run_program(program, 0, arch=0x40000003) == seccomp.SECCOMP_RET_KILL_PROCESS  # i386
    assert seccomp.run_program(program, 0x40000000 | 1) == seccomp.SECCOMP_RET_KILL_PROCESS


def test_seccomp_assembly_is_sock_filter_array() -> None:
    program = seccomp.build_program()
    blob = seccomp.assemble(program)
    assert len(blob) == 8 * len(program)
    assert struct.unpack_from("=HBBI", blob, 0) == program[0]


def test_limits_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=0)
    with pytest.raises(TypeError, match="pids"):
        Limits(pids=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pids"):
        Limits(pids=1)
    assert Limits(cpu=0.5).cpu == 0.5


def test_normalize_path_refuses_escapes() -> None:
    assert normalize_path("a/b.txt") == "/work/a/b.txt"
    assert normalize_path("/tmp//x") == "/tmp/x"
    with pytest.raises(ValueError):
        normalize_path("../etc/passwd")


class _Rlimits:
    """A fake RLIMIT_NOFILE for ensure_fd_headroom."""

    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard, self.set_calls = soft, hard, []

    def getrlimit(self, which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        self.set_calls.append(limits)
        self.soft, self.hard = limits


@pytest.mark.parametrize(("soft", "hard", "max_sandboxes", "after", "warns"), [
    (1024, 1 << 20, 3000, 512 + 4 * 3000, False),   # raised to what 3000 busy sandboxes need
    (1024, 4096, 3000, 4096, True),                 # only up to the hard limit, and it says how many fit
    (65536, 65536, 3000, 65536, False),             # already enough: untouched
    (1024, 1 << 20, 64, 1024, False),               # a small pool needs nothing
])
def test_ensure_fd_headroom(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, soft: int, hard: int,
                            max_sandboxes: int, after: int, warns: bool) -> None:
    from sandboxes import pool

    fake = _Rlimits(soft, hard)
    monkeypatch.setattr(pool.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(pool.resource, "setrlimit", fake.setrlimit)
    with caplog.at_level("WARNING", logger="sandboxes.pool"):
        assert pool.ensure_fd_headroom(max_sandboxes) == after
    assert fake.soft == after and fake.hard == hard
    assert (not fake.set_calls) == (after == soft)
    assert any("RLIMIT_NOFILE" in r.message for r in caplog.records) == warns
    if warns:
        assert "about 896 sandboxes" in caplog.text  # (4096 - 512) // 4


def test_ensure_fd_headroom_unlimited_soft_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandboxes import pool

    fake = _Rlimits(pool.resource.RLIM_INFINITY, pool.resource.RLIM_INFINITY)
    monkeypatch.setattr(pool.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(pool.resource, "setrlimit", fake.setrlimit)
    assert pool.ensure_fd_headroom(50_000) == pool.resource.RLIM_INFINITY
    assert fake.set_calls == []


class _SlowStarts:
    """A sandbox backend whose starts wait for ``gate``; counts the starts running at once."""

    class Fake:
        def __init__(self, n: int) -> None:
            self.id = f"fake-{n}"

        async def reset(self) -> None:
            pass

        async def close(self) -> None:
            pass

    def __init__(self) -> None:
        import asyncio

        self.starting = self.most = self.created = 0
        self.gate = asyncio.Event()

    async def create(self, limits: Limits) -> Any:
        self.starting += 1
        self.most = max(self.most, self.starting)
        try:
            await self.gate.wait()
        finally:
            self.starting -= 1
        self.created += 1
        return self.Fake(self.created)


def _with_slow_backend(test: Callable[[_SlowStarts], Awaitable[None]]) -> None:
    import asyncio

    from sandboxes.registry import register_sandbox_backend, unregister_sandbox_backend

    async def main() -> None:
        backend = _SlowStarts()
        register_sandbox_backend("fake-slow-start", backend.create, description="test")
        try:
            await test(backend)
        finally:
            unregister_sandbox_backend("fake-slow-start")

    asyncio.run(main())


async def _until(cond: Callable[[], bool]) -> None:
    import asyncio

    while not cond():
        await asyncio.sleep(0)


def test_pool_starts_at_most_max_starting_sandboxes_at_once() -> None:
    import asyncio

    from sandboxes.pool import SandboxPool

    async def test(backend: _SlowStarts) -> None:
        pool = await SandboxPool("fake-slow-start", Limits(), size=0, max_size=20, max_starting=3).start()
        try:
            tasks = [asyncio.ensure_future(pool.checkout()) for _ in range(20)]
            await _until(lambda: backend.starting == 3)
            for _ in range(50):  # the others wait for a start slot
                await asyncio.sleep(0)
            assert backend.starting == 3
            backend.gate.set()
            got = await asyncio.gather(*tasks)
            assert len({sb.id for sb in got}) == 20
            assert backend.most == 3
        finally:
            await pool.close()

    _with_slow_backend(test)


def test_pool_checkout_waiting_for_a_start_takes_a_released_sandbox() -> None:
    import asyncio

    from sandboxes.pool import SandboxPool

    async def test(backend: _SlowStarts) -> None:
        pool = await SandboxPool("fake-slow-start", Limits(), size=0, max_size=10, max_starting=1).start()
        try:
            backend.gate.set()
            first = await pool.checkout()
            backend.gate.clear()
            starting = asyncio.ensure_future(pool.checkout())  # takes the only start slot, then waits
            await _until(lambda: backend.starting == 1)
            waiting = asyncio.ensure_future(pool.checkout())  # no idle sandbox, no start slot
            for _ in range(20):
                await asyncio.sleep(0)
            assert not waiting.done()
            await pool.release(first)
            assert await waiting is first  # not queued behind the slow start
            assert backend.starting == 1 and not starting.done()
            backend.gate.set()
            assert (await starting).id == "fake-2"
        finally:
            await pool.close()

    _with_slow_backend(test)


def test_pool_never_opens_more_than_max_size_while_starts_finish() -> None:
    import asyncio

    from sandboxes.pool import SandboxPool

    async def test(backend: _SlowStarts) -> None:
        pool = await SandboxPool("fake-slow-start", Limits(), size=0, max_size=3, max_starting=2).start()
        try:
            tasks = [asyncio.ensure_future(pool.checkout()) for _ in range(6)]
            backend.gate.set()
            await _until(lambda: sum(t.done() for t in tasks) == 3)
            for _ in range(50):  # the other three wait for a release: no fourth sandbox is started
                await asyncio.sleep(0)
            assert backend.created == 3 and backend.starting == 0
            assert sum(t.done() for t in tasks) == 3
            done = [t.result() for t in tasks if t.done()]
            for sb in done:
                await pool.release(sb)
            assert {id(sb) for sb in await asyncio.gather(*tasks)} == {id(sb) for sb in done}
            assert backend.created == 3
        finally:
            await pool.close()

    _with_slow_backend(test)


def test_pool_rejects_max_starting_below_one() -> None:
    from sandboxes.pool import SandboxPool

    with pytest.raises(ValueError, match="max_starting"):
        SandboxPool("bwrap", Limits(), size=0, max_size=4, max_starting=0)
