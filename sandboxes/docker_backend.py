"""The docker backend: a running container per sandbox whose pid 1 is the sandbox init, as in bwrap.

Containers: ``network_mode=none``, read-only root, tmpfs /work, /tmp and /verify, memory/pids/cpu
limits, every capability dropped but the three the init needs (SETUID and SETGID to start commands as
uid 65534, KILL to end them; a command loses all three when it drops to 65534, and with
no-new-privileges and no setuid file in the image it cannot get them back), no-new-privileges, the
engine's default seccomp profile and, stacked on it inside every command, the bwrap backend's filter
(``sandboxes/seccomp.py``: ptrace, namespaces, mounts, keyrings, ... refused).

The init (``sandboxes/sandbox_init.py``) connects at start to a SOCK_SEQPACKET socket this process
listens on in a host directory bind-mounted into the container (``/run/rollout-init``, root-only; the
socket file is removed as soon as the init is connected). Each exec is one message carrying the write
ends of this process's pipes, exactly as for bwrap: no ``docker exec`` (a runc process, several API
round trips) on the path of a command. Hence the engine must run on this host.

Reset, on the lease path, needs no round trip either: from the host, everything in the container's
cgroup but the init is SIGKILLed, and /work, /tmp, /verify, /dev/shm and /dev/mqueue are emptied
through ``/proc/<init>/root`` by directory descriptors (links are removed, never followed), /work's
owner and mode restored. System V IPC objects live in the container's IPC namespace, out of the host's
sight: the init reports after each exec whether any exist, and then the reset is a message to the
init, which does the same and removes them. The environment of every command is
:data:`SANDBOX_ENV` plus what the call passes, so nothing of an episode survives a reset. If a reset
fails or the init died, the container is replaced (the old, slow way). A timeout SIGKILLs, from the
host, everything in the container's cgroup but the init.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import socket
import tarfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from sandboxes import _init_client
from sandboxes._kill import kill_all, kill_all_now
from sandboxes.base import SANDBOX_ENV, VERIFY_DIR, WORKDIR, ExecResult, Sandbox, SandboxError, normalize_path
from sandboxes.limits import Limits
from sandboxes.registry import register_sandbox_backend
from sandboxes.seccomp import SECCOMP_PROGRAM

LABEL = "rollout.sandbox"
OWNER_LABEL = "rollout.sandbox.owner"
UID = 65534
USER = (UID, UID)
ROOT = (0, 0)
INIT_DIR = "/run/rollout-init"
"""Where the host's control directory appears in the container."""
CONTROL_ROOT = Path(os.environ.get("ROLLOUT_SANDBOX_ROOT", "/run/rollout-sandboxes")) / "docker"
START_TIMEOUT_S = 30.0
"""How long a new container's init may take to connect (an engine busy starting many at once is slow)."""
INIT_SOURCE = (Path(__file__).parent / "sandbox_init.py").read_text()
WIPE: list[list[Any]] = [[WORKDIR, UID, UID, 0o700], ["/tmp", UID, UID, None], ["/dev/shm", UID, UID, None],
        ["/dev/mqueue", UID, UID, None], [VERIFY_DIR, 0, 0, None]]
"""What a reset empties, as whom, and the mode it restores on the directory itself."""

log = logging.getLogger(__name__)

_client_lock = threading.Lock()
_client: Any = None


def client() -> Any:
    """A shared docker client (DOCKER_HOST or the default socket)."""
    global _client
    with _client_lock:
        if _client is None:
            import docker

            _client = docker.from_env(timeout=60)
        return _client


def engine_available() -> bool:
    try:
        client().ping()
        return True
    except Exception:
        return False


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _cgroup_dirs(pid: int) -> dict[str, Path]:
    """controller -> cgroup directory of process ``pid`` (v1 controllers, or "unified" for v2)."""
    dirs: dict[str, Path] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else ["unified"]:
            base = Path("/sys/fs/cgroup") / name if name != "unified" else Path("/sys/fs/cgroup")
            if (base / path.lstrip("/")).is_dir():
                dirs[name] = base / path.lstrip("/")
    return dirs


class DockerSandbox(Sandbox):
    """A sandbox in a docker container; create with :meth:`create` (or ``open_sandbox("docker")``)."""

    def __init__(self, limits: Limits, image: str) -> None:
        self.limits = limits
        self.image = image
        self.id = f"rollout-sbx-{uuid.uuid4().hex[:12]}"
        self.container: Any = None
        self.control: socket.socket | None = None
        self.init_pid = 0
        """The init's pid on the host."""
        self._cgroups: dict[str, Path] = {}
        self._root_fd = -1
        """The container's root directory, opened through the init at start: a recycled pid can never
        point a reset at another process's files."""
        self._closed = False
        self._lock = asyncio.Lock()
        self._seq = 0
        self._ipc_used = False
        """An exec left System V IPC objects: the next reset asks the init (we cannot see them)."""

    @classmethod
    async def create(cls, limits: Limits | None = None) -> DockerSandbox:
        from sandboxes.docker_image import ensure_image

        image = await asyncio.to_thread(ensure_image, client())
        sandbox = cls(limits or Limits(), image)
        try:
            await sandbox._start()
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    @property
    def control_dir(self) -> Path:
        return CONTROL_ROOT / self.id

    async def _start(self) -> None:
        """Start a container whose init connects to a socket we listen on; wait for its ``ready``."""
        self.control_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.control_dir / "ctl"
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(str(path))
            listener.listen(1)
            listener.setblocking(False)
            await asyncio.to_thread(self._run_container)
            loop = asyncio.get_running_loop()
            try:
                conn, _ = await asyncio.wait_for(loop.sock_accept(listener), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                logs = await asyncio.to_thread(self._logs)
                raise SandboxError(f"{self.id}: the container's init did not connect within {START_TIMEOUT_S:.0f} s "
                                   f"(the Docker engine must run on this host): {logs}") from None
        finally:
            listener.close()
            path.unlink(missing_ok=True)
        conn.setblocking(False)
        self.control = conn
        ready = await asyncio.wait_for(loop.sock_recv(conn, 4096), START_TIMEOUT_S)
        if not ready:
            raise SandboxError(f"{self.id}: the container's init failed: {await asyncio.to_thread(self._logs)}")
        await asyncio.to_thread(self.container.reload)
        self.init_pid = int(self.container.attrs["State"]["Pid"])
        self._cgroups = _cgroup_dirs(self.init_pid)
        self._root_fd = os.open(f"/proc/{self.init_pid}/root", os.O_RDONLY | os.O_DIRECTORY)

    def _logs(self) -> str:
        try:
            return self.container.logs(tail=20).decode(errors="replace").strip() if self.container else ""
        except Exception as exc:  # only for an error message
            return f"(no logs: {exc})"

    def _run_container(self) -> None:
        lim = self.limits
        self.container = client().containers.run(
            self.image,
            ["/usr/bin/python3", "-I", "-S", "-c", INIT_SOURCE, "--connect", f"{INIT_DIR}/ctl",
             "--seccomp", SECCOMP_PROGRAM.hex()],
            name=f"{self.id}-{uuid.uuid4().hex[:6]}",
            detach=True,
            network_mode="none",
            read_only=True,
            tmpfs={
                WORKDIR: f"size={lim.workspace_mb}m,uid={UID},gid={UID},mode=0700",
                "/tmp": f"size={lim.workspace_mb}m,mode=1777",
                VERIFY_DIR: "size=64m,mode=0755",
            },
            volumes={str(self.control_dir): {"bind": INIT_DIR, "mode": "ro"}},
            mem_limit=f"{lim.memory_mb}m",
            memswap_limit=f"{lim.memory_mb}m",
            pids_limit=lim.pids,
            nano_cpus=int(lim.cpu * 1e9),
            cap_drop=["ALL"],
            cap_add=["SETUID", "SETGID", "KILL"],
            security_opt=["no-new-privileges"],
            ulimits=[
                {"Name": "nofile", "Soft": lim.nofile, "Hard": lim.nofile},
                {"Name": "fsize", "Soft": lim.fsize_mb << 20, "Hard": lim.fsize_mb << 20},
                {"Name": "core", "Soft": 0, "Hard": 0},
            ],
            environment=SANDBOX_ENV,
            working_dir=WORKDIR,
            labels={LABEL: "1", OWNER_LABEL: _owner()},
            init=False,
        )

    # -- exec ------------------------------------------------------------------------------------

    def host_pids(self) -> set[int]:
        """Host pids of every process of the container, the init included."""
        for name in ("pids", "memory", "unified"):
            if name in self._cgroups:
                try:
                    return {int(x) for x in (self._cgroups[name] / "cgroup.procs").read_text().split()}
                except FileNotFoundError:
                    return set()
        return set()

    @property
    def init_pids(self) -> frozenset[int]:
        """The init's host pid: the only process left in the container between execs."""
        return frozenset((self.init_pid,)) if self.init_pid else frozenset()

    def _pids(self) -> set[int]:
        """Host pids of the container's processes but the init."""
        return self.host_pids() - {self.init_pid}

    def _kill_now(self, deadline_s: float = 1.0) -> None:
        kill_all_now(self._pids, deadline_s)

    async def _kill(self, deadline_s: float = 5.0) -> None:
        """SIGKILL every process of the container but the init until none is left."""
        await kill_all(self._pids, self.id, deadline_s)

    def _oom_count(self) -> int:
        """The container's memory cgroup OOM-kill counter."""
        if "memory" in self._cgroups:
            path, prefix = self._cgroups["memory"] / "memory.oom_control", "oom_kill "
        elif "unified" in self._cgroups:
            path, prefix = self._cgroups["unified"] / "memory.events", "oom_kill "
        else:
            return 0
        try:
            for line in path.read_text().splitlines():
                if line.startswith(prefix):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _request(self, argv: list[str], env: dict[str, str] | None, cwd: str | None, stdin: bool,
                 user: tuple[int, int]) -> bytes:
        lim = self.limits
        self._seq += 1
        # no RLIMIT_NPROC: it counts uid 65534's processes across every container of the host; the
        # container's pids limit bounds each sandbox instead.
        return _init_client.request(self._seq, argv, env, cwd, stdin,
                                    {"nofile": lim.nofile, "fsize": lim.fsize_mb << 20, "core": 0}, user=list(user))

    async def exec(
        self,
        cmd: str | list[str],
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return await self._exec(argv, stdin, timeout, env, cwd, USER, self.limits.output_bytes)

    async def _exec(
        self,
        argv: list[str],
        stdin: bytes | None,
        timeout: float | None,
        env: dict[str, str] | None,
        cwd: str | None,
        user: tuple[int, int],
        output_bytes: int,
    ) -> ExecResult:
        self._check_open()
        timeout = self.limits.timeout_s if timeout is None else timeout
        async with self._lock:
            start = time.perf_counter()
            if not self._alive():
                await self._replace()
            assert self.control is not None
            request = self._request(argv, env, cwd, stdin is not None, user)
            oom_before = self._oom_count()
            reply, out, err, timed_out = await _init_client.run(
                self.control, self._seq, request, stdin, timeout - (time.perf_counter() - start), output_bytes,
                kill=self._kill, kill_now=self._kill_now)
            if reply is None:  # the init died (OOM-killed): the next call starts a new container
                self._drop_control()
            exit_code = int(reply["exit_code"]) if reply is not None else 137
            self._ipc_used = self._ipc_used or reply is None or bool(reply.get("ipc", True))
            oom_killed = self._oom_count() > oom_before
        return ExecResult(
            exit_code=exit_code,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=timed_out,
            oom_killed=oom_killed,
            duration_s=time.perf_counter() - start,
            truncated=out.truncated or err.truncated,
        )

    async def write_files(self, files: dict[str, str | bytes]) -> None:
        await self._put(files, prefix="", user=USER, mode=0o644)

    async def write_protected_files(self, files: dict[str, str | bytes]) -> None:
        await self._put(files, prefix=VERIFY_DIR + "/", user=ROOT, mode=0o444)

    async def _put(self, files: dict[str, str | bytes], prefix: str, user: tuple[int, int], mode: int) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path, content in files.items():
                data = content.encode() if isinstance(content, str) else content
                info = tarfile.TarInfo(normalize_path(prefix + path.lstrip("/") if prefix else path).lstrip("/"))
                info.size, info.mode, info.uid, info.gid = len(data), mode, user[0], user[1]
                tar.addfile(info, io.BytesIO(data))
        # Unpacked by busybox tar as the files' owner: as the sandbox user for the workspace, so a link
        # the code planted gains it nothing; as root only into /verify, where the code cannot write.
        result = await self._exec(["tar", "-x", "-C", "/", "-f", "-"], buf.getvalue(), 60, None, "/", user, 1 << 16)
        if result.exit_code != 0:
            raise SandboxError(f"{self.id}: writing files failed: {result.stderr.strip()}")

    async def read_file(self, path: str) -> bytes:
        result = await self._exec(["cat", normalize_path(path)], None, 60, None, None, USER, 1 << 30)
        if result.exit_code != 0:
            raise FileNotFoundError(f"{self.id}: {path}: {result.stderr.strip()}")
        return result.stdout.encode("utf-8", errors="surrogateescape")

    # -- lifecycle -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"{self.id} is closed")

    def _alive(self) -> bool:
        """The init is there: our end of its socket has not seen it close (a reply left over from a
        cancelled exec may be waiting; that is not an end)."""
        if self.control is None:
            return False
        try:
            return bool(self.control.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _drop_control(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    async def _remove_container(self) -> None:
        self._drop_control()
        container, self.container = self.container, None
        if container is not None:
            await asyncio.to_thread(container.remove, force=True)

    async def _replace(self) -> None:
        """The slow reset: a new container."""
        await self._remove_container()
        await self._start()

    async def reset(self) -> None:
        self._check_open()
        async with self._lock:
            if not self._alive():
                await self._replace()
                return
            try:
                if self._ipc_used:
                    await self._reset_by_init()
                else:
                    if self.init_pid not in self.host_pids():
                        raise SandboxError("the init is gone")
                    await self._kill()
                    self._wipe()
                self._ipc_used = False
            except (OSError, SandboxError, asyncio.TimeoutError) as exc:
                log.warning("%s: reset in place failed (%s); replacing the container", self.id, exc)
                await self._replace()

    def _wipe(self) -> None:
        """Empty what :data:`WIPE` names from the host, below the container's root (opened through
        /proc/<init>/root at start), by directory descriptors: no link the code planted is followed.
        Nothing but the init runs. If the container died, its tmpfs mounts are gone and this fails on
        the read-only directories beneath (the caller then replaces the container)."""
        for path, uid, gid, mode in WIPE:
            try:
                fd = os.open(str(path).lstrip("/"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self._root_fd)
            except FileNotFoundError:
                continue
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.name, dir_fd=fd)
                        else:
                            os.unlink(entry.name, dir_fd=fd)
                if mode is not None:
                    os.fchown(fd, uid, gid)
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)

    async def _reset_by_init(self) -> None:
        """The init kills the rest, empties :data:`WIPE` and removes the sandbox user's IPC objects."""
        assert self.control is not None
        self._seq += 1
        request = json.dumps({"seq": self._seq, "op": "reset", "wipe": WIPE, "ipc": UID}).encode()
        await asyncio.get_running_loop().sock_sendall(self.control, request)
        answer = await asyncio.wait_for(_init_client.reply(self.control, self._seq), START_TIMEOUT_S)
        if answer is None:
            raise SandboxError("the init is gone")
        if answer.get("exit_code") != 0:
            raise SandboxError(str(answer.get("error")))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._remove_container()
        finally:
            shutil.rmtree(self.control_dir, ignore_errors=True)


async def reap_containers() -> int:
    """Remove sandbox containers whose owning process (on this host) is gone, and their control dirs."""
    def reap() -> int:
        from sandboxes.deathwatch import process_start_time

        removed = 0
        live: set[str] = set()
        for container in client().containers.list(all=True, filters={"label": LABEL}):
            host, _, pid = container.labels.get(OWNER_LABEL, ":").partition(":")
            if host == socket.gethostname() and pid.isdigit() and process_start_time(int(pid)) is None:
                container.remove(force=True)
                removed += 1
            else:
                live.add(container.name.rsplit("-", 1)[0])
        if CONTROL_ROOT.is_dir():
            for entry in CONTROL_ROOT.iterdir():
                if entry.name not in live and time.time() - entry.stat().st_mtime > START_TIMEOUT_S * 2:
                    shutil.rmtree(entry, ignore_errors=True)
        return removed

    return await asyncio.to_thread(reap)


register_sandbox_backend("docker", DockerSandbox.create, reap=reap_containers,
                         description="a running container per Sandbox whose pid 1 is the sandbox init")
