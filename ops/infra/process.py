"""Processes the stack owns: spawning, pid files, ownership checks, stopping, ports.

A pid file records the pid, the kernel's start time of that process and its exact argv. A pid is
only signalled while /proc still shows the same start time and argv, so a recycled pid or a stranger
that happens to hold it is never touched.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ops.infra.config import HOST
from ops.infra.errors import InfraError, PortInUseError


@dataclass(frozen=True)
class PidRecord:
    """What a pid file holds."""

    pid: int
    start_ticks: int
    argv: list[str]

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> PidRecord | None:
        """The record in ``path``; ``None`` when the file is missing or not one of ours."""
        try:
            data = json.loads(path.read_text())
            return cls(pid=int(data["pid"]), start_ticks=int(data["start_ticks"]), argv=[str(a) for a in data["argv"]])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def of_process(cls, pid: int) -> PidRecord | None:
        """The record describing the live process ``pid`` now, or ``None`` if there is none."""
        stat, argv = _proc_stat(pid), proc_argv(pid)
        if stat is None or argv is None:
            return None
        return cls(pid=pid, start_ticks=stat[1], argv=argv)

    def is_alive(self) -> bool:
        """True while the very process this record describes is running (not a zombie, not a reuse)."""
        stat = _proc_stat(self.pid)
        if stat is None or stat[0] in ("Z", "X") or stat[1] != self.start_ticks:
            return False
        return proc_argv(self.pid) == self.argv


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc, or ``None`` if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def proc_argv(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def spawn(argv: Sequence[str], *, pid_file: Path, log_file: Path, env: Mapping[str, str] | None = None) -> int:
    """Start ``argv`` in its own session (it outlives the CLI), output to ``log_file``; return its pid.

    ``posix_spawn`` rather than ``subprocess.Popen``: the caller keeps no handle to a process that is
    meant to outlive it (a dropped Popen of a running child is a ResourceWarning).
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        pid = os.posix_spawnp(
            argv[0],
            list(argv),
            dict(os.environ if env is None else env),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
            ],
            setsid=True,
        )
    except OSError as exc:
        raise InfraError(f"could not start {argv[0]}: {exc.strerror}") from exc
    finally:
        os.close(log_fd)
    # Right after the spawn, /proc/<pid>/cmdline may still show this process's argv (the exec is not
    # visible yet); a record read then would look like a reused pid. Wait for the exec (bounded).
    deadline = time.monotonic() + 5.0
    while proc_argv(pid) != list(argv) and time.monotonic() < deadline:
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            break
        time.sleep(0.001)
    stat = _proc_stat(pid)
    PidRecord(pid=pid, start_ticks=stat[1] if stat else -1, argv=list(argv)).write(pid_file)
    return pid


def stop_process(pid_file: Path, *, term_timeout_s: float = 30.0) -> int | None:
    """Stop the process recorded in ``pid_file``: SIGTERM, wait, then SIGKILL; remove the file.

    Returns the pid that was stopped, or ``None`` if the record was stale (nothing is signalled).
    """
    record = PidRecord.read(pid_file)
    if record is None or not record.is_alive():
        if record is not None:
            _reap(record)
        pid_file.unlink(missing_ok=True)
        return None
    _signal(record.pid, signal.SIGTERM)
    if not _wait_gone(record, term_timeout_s):
        if record.is_alive():
            _signal(record.pid, signal.SIGKILL)
        if not _wait_gone(record, 10.0):
            raise InfraError(f"pid {record.pid} ({record.argv[0]}) survived SIGKILL")
    pid_file.unlink(missing_ok=True)
    return record.pid


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(record: PidRecord, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while record.is_alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    _reap(record)
    return True


def _reap(record: PidRecord) -> None:
    """Collect the exit status if the recorded process is our own exited child (test fixtures spawn
    servers as children), so it leaves no zombie."""
    stat = _proc_stat(record.pid)
    if stat is None or stat[0] != "Z" or stat[1] != record.start_ticks:
        return
    try:
        os.waitpid(record.pid, os.WNOHANG)
    except ChildProcessError:
        pass


def port_in_use(port: int, host: str = HOST) -> bool:
    """True if something already listens on (or holds) ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port whose last user is in TIME_WAIT is free for a listener.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def ensure_port_free(port: int, flag: str, host: str = HOST) -> None:
    if port_in_use(port, host):
        raise PortInUseError(port, flag)


# Below Linux's ephemeral range (32768-60999): the kernel never hands these out to outgoing
# connections, so a port picked here stays free until our server binds it, however long the wait
# (port 0 would pick from the ephemeral range, where any client socket may take it meanwhile).
_PRIVATE_PORTS = range(20000, 32000)


def free_port(host: str = HOST) -> int:
    """A port that is free now and that no outgoing connection will take (for tests and private servers)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(_PRIVATE_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise InfraError(f"no free port in {_PRIVATE_PORTS.start}-{_PRIVATE_PORTS.stop - 1} on {host}")


def tcp_accepts(port: int, host: str = HOST, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def find_executable(name: str, extra_dirs: Sequence[str] = ("/usr/sbin", "/usr/bin", "/sbin")) -> str | None:
    """``shutil.which``, also looking in the sbin folders a non-login PATH may lack."""
    found = shutil.which(name)
    if found:
        return found
    path = os.pathsep.join(extra_dirs)
    return shutil.which(name, path=path)


def apt_install(packages: Sequence[str]) -> None:
    """Install Debian packages (as root): ``apt-get update`` then ``apt-get install -y``."""
    if os.geteuid() != 0:
        raise InfraError(f"{' '.join(packages)} missing and not root: run `apt-get install -y {' '.join(packages)}` as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Wait for a concurrent apt/dpkg (another setup step) instead of failing on its lock.
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    for argv in (
        ["apt-get", *lock, "update", "-q"],
        ["apt-get", *lock, "install", "-y", "-q", "--no-install-recommends", *packages],
    ):
        print(f"infra: running {' '.join(argv)}", flush=True)
        result = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-10:])
            raise InfraError(f"`{' '.join(argv)}` failed (exit {result.returncode})", log_tail=tail)
