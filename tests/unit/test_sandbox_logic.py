"""Pure logic of sandboxes/: output capping, answer extraction, seccomp assembly, limits."""

from __future__ import annotations

import struct

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
