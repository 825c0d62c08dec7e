"""The one exception type of local infrastructure: its message is a complete, one-line answer."""

from __future__ import annotations


class InfraError(RuntimeError):
    """A local service could not be set up, started, reached or stopped.

    ``str(exc)`` is meant to be printed as is: it names the cause and, where there is one, the fix.
    ``log_tail`` holds the last lines of the service's log when a process died at start-up.
    """

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class PortInUseError(InfraError):
    """A port a service must listen on is already bound by something else."""

    def __init__(self, port: int, flag: str) -> None:
        super().__init__(f"port {port} is in use by another process; pass {flag} or stop it")
        self.port = port
        self.flag = flag
