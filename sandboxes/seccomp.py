"""A seccomp filter as classic BPF bytes, assembled here so no libseccomp is needed.

bubblewrap loads it (``--seccomp FD``) after it has built the sandbox and just before it execs the
command, so bwrap's own mounts and namespace calls are unaffected. The filter is a deny list: it
refuses what a sandboxed program never needs and what widens the kernel's attack surface.

Layout of ``struct seccomp_data`` (linux/seccomp.h): ``nr`` at 0, ``arch`` at 4, ``instruction_pointer``
at 8, ``args[6]`` (u64 each) from 16. Classic BPF loads 32 bits, so an argument's low half is at
``16 + 8 * i`` on little-endian x86-64.
"""

from __future__ import annotations

import struct

# BPF opcodes (linux/bpf_common.h)
BPF_LD, BPF_W, BPF_ABS = 0x00, 0x00, 0x20
BPF_JMP, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_K = 0x05, 0x10, 0x30, 0x40, 0x00
BPF_RET = 0x06
BPF_ALU, BPF_AND = 0x04, 0x50

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
EPERM, ENOSYS = 1, 38

# x86-64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
DENIED_SYSCALLS: dict[str, int] = {
    "ptrace": 101,
    "syslog": 103,
    "pivot_root": 155,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
SYS_IOCTL, SYS_CLONE, SYS_CLONE3 = 16, 56, 435
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# clone(2) flags that create namespaces: CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080

Insn = tuple[int, int, int, int]


def _stmt(code: int, k: int) -> Insn:
    return (code, 0, 0, k)


def _jump(code: int, k: int, jt: int, jf: int) -> Insn:
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
        raise ValueError(f"BPF jump offset out of range: jt={jt} jf={jf}")
    return (code, jt, jf, k)


def build_program(denied: dict[str, int] | None = None) -> list[Insn]:
    """The filter as (code, jt, jf, k) instructions.

    Refused with EPERM: the ``denied`` syscalls, ioctl TIOCSTI/TIOCLINUX (typing into a terminal),
    clone with namespace flags. clone3 gets ENOSYS (its flags sit in memory a filter cannot read; libc
    then falls back to clone). Another architecture or the x32 ABI kills the process.
    """
    numbers = sorted(set((DENIED_SYSCALLS if denied is None else denied).values()))
    head: list[Insn | tuple[str, int]] = [
        _stmt(BPF_LD | BPF_W | BPF_ABS, 4),
        ("arch", AUDIT_ARCH_X86_64),  # placeholder: jeq arch -> next, else KILL
        _stmt(BPF_LD | BPF_W | BPF_ABS, 0),
        ("x32", X32_SYSCALL_BIT),  # jge X32 -> KILL
    ]
    checks: list[tuple[str, int]] = [("eperm", nr) for nr in numbers]
    checks += [("enosys", SYS_CLONE3), ("ioctl", SYS_IOCTL), ("clone", SYS_CLONE)]
    # After the checks come: ALLOW, ioctl block, clone block, EPERM, ENOSYS, KILL.
    n_head, n_checks = len(head), len(checks)
    ioctl_block: list[Insn | tuple[str, int]] = [
        _stmt(BPF_LD | BPF_W | BPF_ABS, 24),  # args[1] low 32 bits: the ioctl request
        ("eq_eperm", TIOCSTI),
        ("eq_eperm", TIOCLINUX),
        ("allow", 0),
    ]
    clone_block: list[Insn | tuple[str, int]] = [
        _stmt(BPF_LD | BPF_W | BPF_ABS, 16),  # args[0] low 32 bits: the clone flags
        ("set_eperm", CLONE_NAMESPACE_FLAGS),
        ("allow", 0),
    ]
    allow_at = n_head + n_checks
    ioctl_at = allow_at + 1
    clone_at = ioctl_at + len(ioctl_block)
    eperm_at = clone_at + len(clone_block)
    enosys_at = eperm_at + 1
    kill_at = enosys_at + 1

    program: list[Insn] = []

    def here() -> int:
        return len(program)

    for item in head:
        if item[0] == "arch":
            program.append(_jump(BPF_JMP | BPF_JEQ | BPF_K, item[1], 0, kill_at - here() - 1))
        elif item[0] == "x32":
            program.append(_jump(BPF_JMP | BPF_JGE | BPF_K, item[1], kill_at - here() - 1, 0))
        else:
            program.append(item)  # type: ignore[arg-type]
    targets = {"eperm": eperm_at, "enosys": enosys_at, "ioctl": ioctl_at, "clone": clone_at}
    for kind, nr in checks:
        program.append(_jump(BPF_JMP | BPF_JEQ | BPF_K, nr, targets[kind] - here() - 1, 0))
    program.append(_stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW))
    for block in (ioctl_block, clone_block):
        for item in block:
            if item[0] == "eq_eperm":
                program.append(_jump(BPF_JMP | BPF_JEQ | BPF_K, item[1], eperm_at - here() - 1, 0))
            elif item[0] == "set_eperm":
                program.append(_jump(BPF_JMP | BPF_JSET | BPF_K, item[1], eperm_at - here() - 1, 0))
            elif item[0] == "allow":
                program.append(_stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW))
            else:
                program.append(item)  # type: ignore[arg-type]
    program.append(_stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM))
    program.append(_stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS))
    program.append(_stmt(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS))
    assert len(program) == kill_at + 1
    return program


def assemble(program: list[Insn]) -> bytes:
    """``struct sock_filter[]`` bytes (u16 code, u8 jt, u8 jf, u32 k), as bwrap's --seccomp reads them."""
    return b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in program)


def run_program(program: list[Insn], nr: int, arch: int = AUDIT_ARCH_X86_64, args: tuple[int, ...] = ()) -> int:
    """Interpret the filter for one syscall (for tests): the SECCOMP_RET_* value it returns."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == BPF_LD | BPF_W | BPF_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == BPF_RET | BPF_K:
            return k
        elif code & 0x07 == BPF_JMP:
            op = code & 0xF0
            taken = {BPF_JEQ: acc == k, BPF_JGE: acc >= k, BPF_JSET: bool(acc & k)}[op]
            pc += jt if taken else jf
        else:
            raise ValueError(f"unsupported BPF instruction {code:#x} at {pc}")
        pc += 1


SECCOMP_PROGRAM: bytes = assemble(build_program())
"""The default filter, assembled once."""
