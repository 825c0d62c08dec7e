"""A Docker engine (``dockerd``) for the docker sandbox backend.

Where it lives: the API socket is ``config.docker_socket`` (default /var/run/docker.sock, so
``docker.from_env()`` reaches it with no configuration; ``DOCKER_HOST`` = :func:`docker_host`), images
and containers stay in ``config.docker_data_root`` (default /var/lib/docker), while its pid file,
exec-root (runtime state, the managed containerd) and log are in ``<state>/docker``. An engine that
already answers on the socket is used as is and never stopped by us.
"""

from __future__ import annotations

import http.client
import socket
from pathlib import Path

from ops.infra.config import InfraConfig
from ops.infra.errors import InfraError
from ops.infra.process import apt_install, find_executable
from ops.infra.service import Service


def docker_host(config: InfraConfig) -> str:
    """``DOCKER_HOST`` value for the configured engine (``unix:///...``)."""
    return config.docker_host


def find_dockerd() -> str | None:
    # Only the daemon counts: /usr/local/bin/docker on these machines is a client without an engine.
    return find_executable("dockerd")


def ensure_dockerd_installed() -> str:
    """Path of ``dockerd``, installing Debian's docker.io first if it is missing."""
    dockerd = find_dockerd()
    if dockerd is None:
        apt_install(["docker.io"])
        dockerd = find_dockerd()
    if dockerd is None:
        raise InfraError("dockerd not found after installing docker.io")
    return dockerd


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def docker_pings(socket_path: Path, timeout_s: float = 3.0) -> bool:
    """True if a Docker engine answers ``GET /_ping`` on ``socket_path``."""
    conn = _UnixHTTPConnection(socket_path, timeout_s)
    try:
        conn.request("GET", "/_ping")
        response = conn.getresponse()
        return response.status == 200 and response.read().strip() == b"OK"
    except OSError:
        return False
    finally:
        conn.close()


class DockerEngine(Service):
    """``dockerd`` started by us, or the engine already answering on the configured socket."""

    name = "docker"
    # dockerd gives running containers 15 s to stop, then stops its containerd.
    stop_timeout_s = 60.0

    @property
    def address(self) -> str:
        return self.config.docker_host

    @property
    def socket_path(self) -> Path:
        return self.config.docker_socket

    @property
    def docker_host(self) -> str:
        return self.config.docker_host

    def ports(self) -> list[tuple[int, str]]:
        return []

    def check_ports(self) -> None:
        if self.is_external():
            raise InfraError(f"a Docker engine not started by this state dir already answers on {self.socket_path}")

    def argv(self) -> list[str]:
        dockerd = find_dockerd()
        if dockerd is None:
            raise InfraError("dockerd not found: install docker.io (apt-get install docker.io) or pass --docker to `up`")
        return [
            dockerd,
            "--host", self.docker_host,
            "--pidfile", str(self.dir / "dockerd.pid"),
            "--exec-root", str(self.dir / "exec"),
            "--data-root", str(self.config.docker_data_root),
        ]  # fmt: skip

    def prepare(self) -> None:
        ensure_dockerd_installed()
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)

    def is_external(self) -> bool:
        """True if an engine we did not start answers on our socket."""
        return not self.is_running() and self.is_healthy()

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        return docker_pings(self.socket_path, timeout_s)
