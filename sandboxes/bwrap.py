"""The default backend: one bubblewrap process per exec, over a workspace that persists between execs.

A sandbox owns (all named after its id, ``sbx-<uid>``):

- a host uid (200000 + n) that nothing else uses; bwrap runs as that uid, so the sandboxed code has
  no privilege on the host even outside its namespaces, and RLIMIT_NPROC counts only its processes;
- a tmpfs of ``limits.workspace_mb`` mounted at ``<root>/sbx-<uid>`` holding ``work/`` (-> /work),
  ``tmp/`` (-> /tmp) and the root-owned ``verify/`` (-> /verify, read-only);
- cgroups ``rollout/sbx-<uid>`` (memory, pids, cpu);
- an owner file ``<root>/sbx-<uid>.owner`` ("pid starttime") that claims the uid and tells the
  reaper whether the owning process is still alive.

Each exec: bwrap starts blocked (``--block-fd``), reports its namespace child (``--info-fd``); both are
put into the cgroups before they can fork, then released. The command runs in new user, pid, mount,
net, ipc, uts and cgroup namespaces under the seccomp filter, with a minimal /etc and environment, and
rlimits set by ``prlimit`` inside (this VM's root lacks CAP_SYS_RESOURCE, so the parent cannot set them
on the child). When the command's process exits, bwrap (pid 1 of the pid namespace) exits and the
kernel kills everything left in the namespace, so no background process survives an exec.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from sandboxes import _aio
from sandboxes.base import (
    SANDBOX_ENV,
    VERIFY_DIR,
    WORKDIR,
    ExecResult,
    OutputCap,
    Sandbox,
    SandboxError,
    normalize_path,
)
from sandboxes.cgroups import CgroupSet, available_controllers
from sandboxes.limits import Limits
from sandboxes.seccomp import SECCOMP_PROGRAM

SANDBOX_ROOT = Path(os.environ.get("ROLLOUT_SANDBOX_ROOT", "/run/rollout-sandboxes"))
UID_BASE = 200_000
UID_COUNT = 50_000
INNER_UID = 65534
PREFIX = "sbx-"
KILL_GRACE_S = 2.0
"""How long to wait for pipes to close after a kill before giving up on the output."""

_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV = 0x2, 0x4
PR_SET_CHILD_SUBREAPER = 36
MNT_DETACH = 0x2

PASSWD = f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nsandbox:x:{INNER_UID}:{INNER_UID}:sandbox:{WORKDIR}:/bin/sh\n"
GROUP = f"root:x:0:\nsandbox:x:{INNER_UID}:\n"
ETC_FILES = {
    "passwd": PASSWD,
    "group": GROUP,
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    "hostname": "sandbox\n",
}


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _mount_tmpfs(target: Path, size_mb: int) -> None:
    opts = f"size={size_mb}m,mode=0755,nr_inodes=65536".encode()
    if _libc.mount(b"tmpfs", bytes(target), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def _umount(target: Path) -> None:
    if _libc.umount2(bytes(target), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not mounted / gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat: tells a live process from a recycled pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class _Host:
    """Per-process facts and files shared by all bwrap sandboxes; prepared once."""

    def __init__(self) -> None:
        self.root = SANDBOX_ROOT
        self.privileged = os.geteuid() == 0
        self.controllers: tuple[str, ...] = available_controllers() if self.privileged else ()
        self.can_mount = self.privileged
        self.bwrap = bwrap_path()
        self.etc = self.root / "etc"
        self.next_uid = UID_BASE + (os.getpid() * 7919) % UID_COUNT
        # bwrap exits as soon as its namespace's init reports the command's status, without reaping
        # that init; the orphan goes to the nearest subreaper. On a host whose pid 1 does not reap
        # (this VM, containers without --init) it would stay a zombie and count against RLIMIT_NPROC,
        # so this process adopts it and reaps it by pid (see BwrapSandbox._reap_child).
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self._prepare()
        self.static_args = self._static_args()

    def _prepare(self) -> None:
        if self.bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.etc.mkdir(mode=0o755, exist_ok=True)
        for name, text in ETC_FILES.items():
            path = self.etc / name
            if not path.exists() or path.read_text() != text:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.chmod(0o644)
                tmp.replace(path)
        if Path("/etc/ld.so.cache").exists() and not (self.etc / "ld.so.cache").exists():
            shutil.copyfile("/etc/ld.so.cache", self.etc / "ld.so.cache")
        (self.etc / "alternatives").mkdir(exist_ok=True)
        if self.can_mount:
            probe = self.root / "probe"
            probe.mkdir(exist_ok=True)
            try:
                _mount_tmpfs(probe, 1)
                _umount(probe)
            except OSError:
                self.can_mount = False
            probe.rmdir()

    def _static_args(self) -> list[str]:
        args = [self.bwrap or "bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
        args += ["--hostname", "sandbox", "--uid", str(INNER_UID), "--gid", str(INNER_UID)]
        args += ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "lib", "lib64", "sbin"):
            host = Path("/" + top)
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{top}"]
        args += ["--ro-bind", str(self.etc), "/etc"]
        if Path("/etc/alternatives").is_dir():
            args += ["--ro-bind", "/etc/alternatives", "/etc/alternatives"]
        args += ["--proc", "/proc", "--dev", "/dev", "--clearenv"]
        return args

    def claim_uid(self) -> int:
        """A uid no live sandbox on this host uses, claimed by creating its owner file."""
        owner = f"{os.getpid()} {process_start_time(os.getpid())}\n".encode()
        for _ in range(UID_COUNT):
            uid = self.next_uid
            self.next_uid = UID_BASE + (uid - UID_BASE + 1) % UID_COUNT
            try:
                fd = os.open(self.root / f"{PREFIX}{uid}.owner", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            os.write(fd, owner)
            os.close(fd)
            return uid
        raise SandboxError("no free sandbox uid: too many sandboxes on this host")


_HOST: _Host | None = None


def host() -> _Host:
    global _HOST
    if _HOST is None:
        _HOST = _Host()
    return _HOST


class BwrapSandbox(Sandbox):
    """A bubblewrap sandbox; create with :meth:`create` (or ``open_sandbox``)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._host = host()
        self.uid = self._host.claim_uid() if self._host.privileged else os.getuid()
        self.id = f"{PREFIX}{self.uid}" if self._host.privileged else f"{PREFIX}u{os.getpid()}-{id(self):x}"
        self.dir = self._host.root / self.id
        self.cgroups = CgroupSet(self.id, self._host.controllers)
        self._closed = False
        self._running: set[subprocess.Popen[bytes]] = set()

    @classmethod
    async def create(cls, limits: Limits | None = None) -> BwrapSandbox:
        sandbox = cls(limits or Limits())
        try:
            sandbox.cgroups.create(sandbox.limits.memory_mb, sandbox.limits.pids, sandbox.limits.cpu)
            sandbox._make_workspace()
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    # -- workspace -------------------------------------------------------------------------------

    def _make_workspace(self) -> None:
        self.dir.mkdir(mode=0o755, exist_ok=True)
        if self._host.can_mount:
            _mount_tmpfs(self.dir, self.limits.workspace_mb)
        for sub, mode in (("work", 0o700), ("tmp", 0o700), ("verify", 0o755)):
            path = self.dir / sub
            path.mkdir(mode=mode, exist_ok=True)
            if sub != "verify" and self._host.privileged:
                os.chown(path, self.uid, self.uid)

    def _drop_workspace(self) -> None:
        if self._host.can_mount:
            _umount(self.dir)
        if self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)

    def _host_path(self, path: str) -> Path:
        """Where an in-sandbox path under /work, /tmp or /verify lives on the host."""
        absolute = normalize_path(path)
        for inner, sub in ((WORKDIR, "work"), ("/tmp", "tmp"), (VERIFY_DIR, "verify")):
            if absolute == inner or absolute.startswith(inner + "/"):
                return self.dir / sub / absolute[len(inner) :].lstrip("/")
        raise ValueError(f"path {path!r} is not under {WORKDIR}, /tmp or {VERIFY_DIR}")

    async def write_files(self, files: dict[str, str | bytes]) -> None:
        self._check_open()
        for path, content in files.items():
            self._write_host_file(self._host_path(path), content, owner=self.uid, mode=0o644)

    async def write_protected_files(self, files: dict[str, str | bytes]) -> None:
        self._check_open()
        for path, content in files.items():
            target = self._host_path(f"{VERIFY_DIR}/{path.lstrip('/')}")
            self._write_host_file(target, content, owner=None, mode=0o444)

    def _write_host_file(self, target: Path, content: str | bytes, owner: int | None, mode: int) -> None:
        data = content.encode() if isinstance(content, str) else content
        # Never follow a link the sandboxed code planted: open with O_NOFOLLOW at every level we create.
        top = self.dir / target.relative_to(self.dir).parts[0]
        parent = top
        for part in target.relative_to(top).parts[:-1]:
            parent = parent / part
            if parent.is_symlink():
                raise SandboxError(f"refusing to write through a symlink: {parent}")
            if not parent.exists():
                parent.mkdir(mode=0o755)
                if owner is not None and self._host.privileged:
                    os.chown(parent, owner, owner)
        if target.is_symlink():
            target.unlink()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
            if owner is not None and self._host.privileged:
                os.fchown(fd, owner, owner)
        finally:
            os.close(fd)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        fd = self._open_beneath(self._host_path(path))
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _open_beneath(self, target: Path) -> int:
        """Open ``target`` for reading without following any symlink the sandboxed code may have
        planted on the way (a link to / would otherwise read the host's files)."""
        rel = target.relative_to(self.dir).parts
        dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in rel[:-1]:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = next_fd
            return os.open(rel[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    # -- exec ------------------------------------------------------------------------------------

    def _argv(
        self, cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, fds: dict[str, int]
    ) -> list[str]:
        lim = self.limits
        args = list(self._host.static_args)
        args += ["--bind", str(self.dir / "work"), WORKDIR, "--bind", str(self.dir / "tmp"), "/tmp"]
        args += ["--ro-bind", str(self.dir / "verify"), VERIFY_DIR, "--remount-ro", "/"]
        args += ["--chdir", normalize_path(cwd) if cwd else WORKDIR]
        for key, value in {**SANDBOX_ENV, **(env or {})}.items():
            args += ["--setenv", key, value]
        args += ["--seccomp", str(fds["seccomp"]), "--info-fd", str(fds["info"]), "--block-fd", str(fds["block"])]
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("empty command")
        fsize = lim.fsize_mb * 1024 * 1024
        rlimits = [f"--nofile={lim.nofile}", f"--fsize={fsize}", "--core=0", f"--nproc={lim.pids}"]
        return args + ["--", "/usr/bin/prlimit", *rlimits, "--", *argv]

    async def exec(
        self,
        cmd: str | list[str],
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        self._check_open()
        timeout = self.limits.timeout_s if timeout is None else timeout
        start = time.perf_counter()
        oom_before = self.cgroups.oom_kills()
        out_cap, err_cap = OutputCap(self.limits.output_bytes), OutputCap(self.limits.output_bytes)

        to_close: list[int] = []
        seccomp_r, seccomp_w = os.pipe()
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin else (subprocess.DEVNULL, -1)
        to_close += [seccomp_r, info_r, block_w, out_r, err_r] + ([in_w] if stdin else [])
        child_ends = [seccomp_r, info_w, block_r, out_w, err_w] + ([in_r] if stdin else [])
        os.write(seccomp_w, SECCOMP_PROGRAM)  # ~500 bytes: fits the pipe buffer
        os.close(seccomp_w)
        proc: subprocess.Popen[bytes] | None = None
        pidfd = child_pidfd = -1
        child_pid = 0
        try:
            argv = self._argv(cmd, env, cwd, {"seccomp": seccomp_r, "info": info_w, "block": block_r})
            ids = {"user": self.uid, "group": self.uid, "extra_groups": []} if self._host.privileged else {}
            proc = subprocess.Popen(
                argv,
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(seccomp_r, info_w, block_r),
                env={},
                close_fds=True,
                start_new_session=True,
                **ids,  # type: ignore[arg-type]
            )
            self._running.add(proc)
            pidfd = os.pidfd_open(proc.pid)
            for fd in child_ends:
                if fd >= 0:
                    os.close(fd)
            child_ends = []
            for fd in (info_r, out_r, err_r, *([in_w] if stdin else [])):
                os.set_blocking(fd, False)

            info = await asyncio.wait_for(_aio.read_json_object(info_r), timeout=max(timeout, 5.0))
            if not info:
                raise SandboxError(f"bwrap failed to start: exit {proc.wait()}")
            child_pid = int(json.loads(info)["child-pid"])
            child_pidfd = os.pidfd_open(child_pid)
            self.cgroups.add(proc.pid)
            self.cgroups.add(child_pid)
            os.write(block_w, b"x")

            tasks = [
                asyncio.ensure_future(_aio.drain(out_r, out_cap)),
                asyncio.ensure_future(_aio.drain(err_r, err_cap)),
                asyncio.ensure_future(_aio.wait_readable(pidfd)),
            ]
            if stdin:
                to_close.remove(in_w)
                tasks.append(asyncio.ensure_future(_aio.write_all(in_w, stdin)))
            remaining = timeout - (time.perf_counter() - start)
            done, pending = await asyncio.wait(tasks, timeout=max(remaining, 0.0))
            timed_out = bool(pending)
            if timed_out:
                await self._kill(proc)
                done, pending = await asyncio.wait(pending, timeout=KILL_GRACE_S)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()
            returncode = proc.wait()
            await self._reap_child(child_pid, child_pidfd)
        except BaseException:
            if proc is not None:
                await self._kill(proc)
                proc.wait()
                if child_pidfd >= 0:
                    await self._reap_child(child_pid, child_pidfd)
            raise
        finally:
            if proc is not None:
                self._running.discard(proc)
            for fd in to_close + child_ends + [x for x in (pidfd, child_pidfd) if x >= 0]:
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        # bwrap reports a command killed by signal N as 128 + N; bwrap itself killed gives -N.
        exit_code = 128 - returncode if returncode < 0 else returncode
        oom_killed = self.cgroups.oom_kills() > oom_before
        if self.cgroups.pids():  # a process escaped the namespace teardown: never leave one behind
            await self._kill_cgroup()
        return ExecResult(
            exit_code=exit_code,
            stdout=out_cap.text(),
            stderr=err_cap.text(),
            timed_out=timed_out,
            oom_killed=oom_killed,
            duration_s=time.perf_counter() - start,
            truncated=out_cap.truncated or err_cap.truncated,
        )

    @staticmethod
    async def _reap_child(child_pid: int, child_pidfd: int) -> None:
        """Reap bwrap's namespace child, which bwrap leaves to us (the subreaper) when it exits first."""
        try:
            await asyncio.wait_for(_aio.wait_readable(child_pidfd), KILL_GRACE_S)
        except asyncio.TimeoutError:
            os.kill(child_pid, signal.SIGKILL)
            await _aio.wait_readable(child_pidfd)
        try:
            os.waitpid(child_pid, os.WNOHANG)
        except ChildProcessError:
            pass  # bwrap reaped it itself

    async def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill bwrap (its namespace child dies with it, and with that every process in the namespace)
        and then anything still in the cgroup."""
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await self._kill_cgroup()

    async def _kill_cgroup(self, deadline_s: float = 5.0) -> None:
        end = time.monotonic() + deadline_s
        while pids := self.cgroups.pids():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > end:
                raise SandboxError(f"{self.id}: processes {pids} survive SIGKILL")
            await asyncio.sleep(0.001)

    # -- lifecycle -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"{self.id} is closed")

    async def reset(self) -> None:
        self._check_open()
        for proc in list(self._running):
            await self._kill(proc)
        await self._kill_cgroup()
        self._drop_workspace()
        self._make_workspace()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in list(self._running):
            await self._kill(proc)
        await self._kill_cgroup()
        self.cgroups.remove()
        self._drop_workspace()
        if self._host.privileged:
            try:
                (self._host.root / f"{self.id}.owner").unlink()
            except FileNotFoundError:
                pass

    def statistics(self) -> dict[str, int]:
        """Kernel counters of this sandbox (a snapshot)."""
        return {"oom_kills": self.cgroups.oom_kills(), "memory_failcnt": self.cgroups.memory_failcnt()}
