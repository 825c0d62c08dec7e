"""The shape every locally managed process shares: a folder in the state dir, a pid file, a log."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path

from ops.infra.config import InfraConfig
from ops.infra.errors import InfraError
from ops.infra.process import PidRecord, ensure_port_free, log_tail, spawn, stop_process


class Service(ABC):
    """A server process that ``start()`` spawns detached and ``stop()`` ends by its recorded pid."""

    name: str
    stop_timeout_s: float = 30.0

    def __init__(self, config: InfraConfig) -> None:
        self.config = config

    @property
    def dir(self) -> Path:
        return self.config.state_dir / self.name

    @property
    def pid_file(self) -> Path:
        return self.dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        """Where the process's stdout and stderr go."""
        return self.dir / f"{self.name}.out"

    @property
    @abstractmethod
    def address(self) -> str:
        """How clients reach the service (e.g. ``127.0.0.1:9092``)."""

    @abstractmethod
    def ports(self) -> list[tuple[int, str]]:
        """(port, CLI flag that changes it) for each port the service binds."""

    @abstractmethod
    def argv(self) -> list[str]:
        """The command line of the server process."""

    @abstractmethod
    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        """True if the service answers a real request within ``timeout_s``."""

    def prepare(self) -> None:
        """Whatever must exist before the first start (binaries, formatted storage)."""

    def pid(self) -> int | None:
        """Pid of the process this state dir started, if it is still that process."""
        record = PidRecord.read(self.pid_file)
        return record.pid if record is not None and record.is_alive() else None

    def is_running(self) -> bool:
        return self.pid() is not None

    def check_ports(self) -> None:
        for port, flag in self.ports():
            ensure_port_free(port, flag)

    def start(self) -> int:
        """Spawn the server unless ours is already running; return its pid. Does not wait."""
        pid = self.pid()
        if pid is not None:
            return pid
        self.pid_file.unlink(missing_ok=True)
        self.check_ports()
        self.prepare()
        self.dir.mkdir(parents=True, exist_ok=True)
        return spawn(self.argv(), pid_file=self.pid_file, log_file=self.log_file)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the service answers; fail early, with its log, if the process dies."""
        timeout_s = self.config.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.is_running():
                raise InfraError(f"{self.name} exited during start-up; see {self.log_file}", log_tail=self.startup_log())
            if self.is_healthy(timeout_s=min(3.0, max(0.5, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                raise InfraError(
                    f"{self.name} did not answer at {self.address} within {timeout_s:.0f}s; see {self.log_file}",
                    log_tail=self.startup_log(),
                )
            time.sleep(0.25)

    def startup_log(self) -> str:
        """The log lines that explain a failed start."""
        return log_tail(self.log_file)

    def stop(self) -> int | None:
        """Stop our process (SIGTERM, then SIGKILL); return its pid, or ``None`` if none was running."""
        return stop_process(self.pid_file, term_timeout_s=self.stop_timeout_s)
