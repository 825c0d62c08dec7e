"""The docker backend: a running container per sandbox (``sleep`` as pid 1), commands via the exec API.

Containers: ``network_mode=none``, read-only root, tmpfs /work, /tmp and /verify, memory/pids/cpu
limits, all capabilities dropped, no-new-privileges; commands run as uid 65534. The docker SDK is
synchronous, so every call runs in a worker thread. Reset replaces the container.
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
import tarfile
import threading
import time
import uuid
from typing import Any

from sandboxes.base import SANDBOX_ENV, VERIFY_DIR, WORKDIR, ExecResult, OutputCap, Sandbox, SandboxError, normalize_path
from sandboxes.limits import Limits

LABEL = "rollout.sandbox"
OWNER_LABEL = "rollout.sandbox.owner"
USER = "65534:65534"

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


class DockerSandbox(Sandbox):
    """A sandbox in a docker container; create with :meth:`create` (or ``open_sandbox("docker")``)."""

    def __init__(self, limits: Limits, image: str) -> None:
        self.limits = limits
        self.image = image
        self.id = f"rollout-sbx-{uuid.uuid4().hex[:12]}"
        self.container: Any = None
        self._closed = False

    @classmethod
    async def create(cls, limits: Limits | None = None) -> DockerSandbox:
        from sandboxes.docker_image import ensure_image

        image = await asyncio.to_thread(ensure_image, client())
        sandbox = cls(limits or Limits(), image)
        await asyncio.to_thread(sandbox._start)
        return sandbox

    def _start(self) -> None:
        lim = self.limits
        self.container = client().containers.run(
            self.image,
            ["sleep", "2147483647"],
            name=f"{self.id}-{uuid.uuid4().hex[:6]}",
            detach=True,
            network_mode="none",
            read_only=True,
            tmpfs={
                WORKDIR: f"size={lim.workspace_mb}m,uid=65534,gid=65534,mode=0700",
                "/tmp": f"size={lim.workspace_mb}m,mode=1777",
                VERIFY_DIR: "size=64m,mode=0755",
            },
            mem_limit=f"{lim.memory_mb}m",
            memswap_limit=f"{lim.memory_mb}m",
            pids_limit=lim.pids,
            nano_cpus=int(lim.cpu * 1e9),
            cap_drop=["ALL"],
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

    def _exec_blocking(
        self, argv: list[str], stdin: bytes | None, env: dict[str, str], cwd: str, user: str, cap: int, stop: threading.Event
    ) -> tuple[int | None, OutputCap, OutputCap]:
        api = client().api
        exec_id = api.exec_create(
            self.container.id, argv, stdin=stdin is not None, user=user, workdir=cwd, environment=env
        )["Id"]
        sock = api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        out, err = OutputCap(cap), OutputCap(cap)
        try:
            if stdin is not None:
                raw.sendall(stdin)
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(0.2)
            buf = b""
            while not stop.is_set():
                try:
                    chunk = raw.recv(1 << 18)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                buf += chunk
                # the exec stream is multiplexed: 8-byte header (stream, 0,0,0, big-endian size), payload
                while len(buf) >= 8:
                    size = int.from_bytes(buf[4:8], "big")
                    if len(buf) < 8 + size:
                        break
                    (err if buf[0] == 2 else out).feed(buf[8 : 8 + size])
                    buf = buf[8 + size :]
        finally:
            # ``sock`` is a SocketIO holding an io reference on ``raw``: close both, or the socket is
            # only marked closed and leaks its descriptor until garbage collection.
            if sock is not raw:
                sock.close()
            raw.close()
        code = api.exec_inspect(exec_id).get("ExitCode")
        return code, out, err

    async def exec(
        self,
        cmd: str | list[str],
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        return await self._exec(cmd, stdin, timeout, env, cwd, USER, self.limits.output_bytes)

    async def _exec(
        self,
        cmd: str | list[str],
        stdin: bytes | None,
        timeout: float | None,
        env: dict[str, str] | None,
        cwd: str | None,
        user: str,
        cap: int,
    ) -> ExecResult:
        self._check_open()
        timeout = self.limits.timeout_s if timeout is None else timeout
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        start = time.perf_counter()
        oom_before = await asyncio.to_thread(self._oom_count)
        stop = threading.Event()
        job = asyncio.ensure_future(
            asyncio.to_thread(
                self._exec_blocking, argv, stdin, {**SANDBOX_ENV, **(env or {})}, normalize_path(cwd or WORKDIR), user, cap, stop
            )
        )
        timed_out = False
        try:
            code, out, err = await asyncio.wait_for(asyncio.shield(job), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            await self._kill_user_processes()
            stop.set()
            code, out, err = await job
        finally:
            stop.set()
        oom_killed = (await asyncio.to_thread(self._oom_count)) > oom_before
        return ExecResult(
            exit_code=137 if timed_out or code is None else code,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=timed_out,
            oom_killed=oom_killed,
            duration_s=time.perf_counter() - start,
            truncated=out.truncated or err.truncated,
        )

    def _oom_count(self) -> int:
        """The container's memory cgroup OOM-kill counter (cgroup v1 via the engine's cgroupfs driver)."""
        path = f"/sys/fs/cgroup/memory/docker/{self.container.id}/memory.oom_control"
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    async def _kill_user_processes(self) -> None:
        """SIGKILL every process of the sandbox user (pid 1 runs as root and survives)."""
        def kill() -> None:
            api = client().api
            exec_id = api.exec_create(self.container.id, ["kill", "-9", "-1"], user=USER)["Id"]
            api.exec_start(exec_id)

        await asyncio.to_thread(kill)

    async def write_files(self, files: dict[str, str | bytes]) -> None:
        await self._put(files, prefix="", owner=65534, mode=0o644)

    async def write_protected_files(self, files: dict[str, str | bytes]) -> None:
        await self._put(files, prefix=VERIFY_DIR + "/", owner=0, mode=0o444)

    async def _put(self, files: dict[str, str | bytes], prefix: str, owner: int, mode: int) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path, content in files.items():
                data = content.encode() if isinstance(content, str) else content
                info = tarfile.TarInfo(normalize_path(prefix + path.lstrip("/") if prefix else path).lstrip("/"))
                info.size, info.mode, info.uid, info.gid = len(data), mode, owner, owner
                tar.addfile(info, io.BytesIO(data))
        # put_archive refuses a read-only root even for tmpfs paths, so the tar goes through an exec.
        user = "0:0" if owner == 0 else USER
        result = await self._exec(["tar", "-x", "-C", "/", "-f", "-"], buf.getvalue(), 60, None, "/", user, 1 << 16)
        if result.exit_code != 0:
            raise SandboxError(f"{self.id}: writing files failed: {result.stderr.strip()}")

    async def read_file(self, path: str) -> bytes:
        result = await self._exec(["cat", normalize_path(path)], None, 60, None, None, USER, 1 << 30)
        if result.exit_code != 0:
            raise FileNotFoundError(f"{self.id}: {path}: {result.stderr.strip()}")
        return result.stdout.encode("utf-8", errors="surrogateescape")

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"{self.id} is closed")

    async def reset(self) -> None:
        self._check_open()
        old = self.container
        await asyncio.to_thread(self._start)
        await asyncio.to_thread(old.remove, force=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.container is not None:
            await asyncio.to_thread(self.container.remove, force=True)


async def reap_containers() -> int:
    """Remove sandbox containers whose owning process (on this host) is gone."""
    def reap() -> int:
        from sandboxes.bwrap import process_start_time

        removed = 0
        for container in client().containers.list(all=True, filters={"label": LABEL}):
            host, _, pid = container.labels.get(OWNER_LABEL, ":").partition(":")
            if host == socket.gethostname() and pid.isdigit() and process_start_time(int(pid)) is None:
                container.remove(force=True)
                removed += 1
        return removed

    return await asyncio.to_thread(reap)
