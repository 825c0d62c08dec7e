"""Start and stop the embedded `local` inference server as a child process.

The server prints one JSON line ``{"event": "listening", ..., "url": ...}`` once its socket listens;
readiness is then ``/health_generate`` answering 200. The child is stopped by its pid (SIGTERM,
then SIGKILL after a grace period), never by name. An api key reaches the child in its environment
(``ROLLOUT__INFERENCE__API_KEY``), never on its command line, which every user of the host can read.

A model directory that cannot be served (:func:`modelserver.model_dir.check_model_dir`) is refused before
any process is spawned, and a child that exits during start-up (the server exits when its model fails
to load) ends the wait at once: a bad directory is reported in seconds, not after the start-up timeout.

This module also registers the built-in inference backends (:mod:`modelserver.backends`):
``local`` launches a :class:`LocalServer`; ``sglang`` serves only through servers started elsewhere.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from modelserver.backends import register_inference_backend
from modelserver.client import SGLangClient
from modelserver.model_dir import ModelDirError, check_model_dir
from engine.config import INFERENCE_API_KEY_ENV as API_KEY_ENV

if TYPE_CHECKING:
    from engine.config import InferenceConfig


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the daemon that started it dies, even by SIGKILL.

    The server runs in its own session (a terminal's Ctrl-C must not reach it), so without this a
    SIGKILLed inference daemon (OOM killer, a host agent) would leave an orphan server holding the model's
    memory and CPU. Linux only; elsewhere a no-op.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class LocalServerError(RuntimeError):
    """The local inference server did not start; the message says why and where its log is."""


class LocalServer:
    """``async with LocalServer(model_dir) as url:`` runs `rollout inference serve` on a free port."""

    def __init__(self, model_dir: str | Path, *, log_path: str | Path, weight_version: str = "0",
                 max_batch: int = 64, chunk_size: int = 512, torch_threads: int = 1,
                 startup_timeout_s: float = 120.0, api_key: str | None = None, dtype: str = "fp32",
                 prefix_cache_tokens: int = 8192, attention_window: int | None = None,
                 attention_sinks: int = 0, prefix_cache_int8_tokens: int = 0, backend: str = "local",
                 kv_cache: str = "paged", kv_cache_tokens: int = 65536, prefix_cache_disk_tokens: int = 0,
                 prefix_cache_disk_dir: str | None = None, rescore: bool = False) -> None:
        self.model_dir = str(model_dir)
        self.rescore = rescore
        self.api_key = api_key
        self.log_path = Path(log_path)
        self.weight_version = weight_version
        self.max_batch = max_batch
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.prefix_cache_tokens = prefix_cache_tokens
        self.prefix_cache_int8_tokens = prefix_cache_int8_tokens
        self.prefix_cache_disk_tokens = prefix_cache_disk_tokens
        self.prefix_cache_disk_dir = prefix_cache_disk_dir
        self.kv_cache = kv_cache
        self.kv_cache_tokens = kv_cache_tokens
        self.backend = backend
        self.attention_window = attention_window
        self.attention_sinks = attention_sinks
        self.torch_threads = torch_threads
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None

    async def start(self) -> str:
        try:
            check_model_dir(self.model_dir)
        except ModelDirError as exc:
            raise LocalServerError(f"cannot serve model directory {self.model_dir}: {exc}") from None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "ops.cli", "inference", "serve", "--port", "0", "--model-dir", self.model_dir,
                "--weight-version", self.weight_version, "--max-batch", str(self.max_batch),
                "--chunk-size", str(self.chunk_size), "--torch-threads", str(self.torch_threads),
                "--dtype", self.dtype, "--prefix-cache-tokens", str(self.prefix_cache_tokens),
                "--prefix-cache-int8-tokens", str(self.prefix_cache_int8_tokens), "--backend", self.backend]
        if self.backend == "local":
            argv += ["--kv-cache", self.kv_cache, "--kv-cache-tokens", str(self.kv_cache_tokens),
                     "--rescore" if self.rescore else "--no-rescore"]
            if self.prefix_cache_disk_tokens:
                argv += ["--prefix-cache-disk-tokens", str(self.prefix_cache_disk_tokens)]
                if self.prefix_cache_disk_dir:
                    argv += ["--prefix-cache-disk-dir", self.prefix_cache_disk_dir]
        if self.attention_window is not None:
            argv += ["--attention-window", str(self.attention_window), "--attention-sinks", str(self.attention_sinks)]
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)  # the key is this object's, not whatever the parent's environment holds
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, start_new_session=True, env=env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        log.close()
        assert self.proc.stdout is not None
        try:
            with anyio.fail_after(self.startup_timeout_s):
                line = await anyio.to_thread.run_sync(self.proc.stdout.readline)
                if not line:
                    raise self._exited()
                self.url = json.loads(line)["url"]
                async with SGLangClient([self.url], timeout=10, retries=0, api_key=self.api_key) as client:
                    while not await client.health_generate():
                        if self.proc.poll() is not None:
                            raise self._exited()
                        await anyio.sleep(0.1)
        except TimeoutError:
            self.stop()
            raise LocalServerError(f"local inference server for {self.model_dir} not healthy after "
                                   f"{self.startup_timeout_s}s: {self._last_log_line()} (log: {self.log_path})") from None
        except BaseException:
            self.stop()
            raise
        return self.url

    def _exited(self) -> LocalServerError:
        assert self.proc is not None
        rc = self.proc.wait()
        return LocalServerError(f"local inference server for {self.model_dir} exited with code {rc} during start-up: "
                                f"{self._last_log_line()} (log: {self.log_path})")

    def _last_log_line(self) -> str:
        """The server's last word: its last log line that is not part of a traceback's frames."""
        try:
            lines = self.log_path.read_bytes()[-8000:].decode("utf-8", "replace").splitlines()
        except OSError:
            return "(no log)"
        lines = [ln.strip() for ln in lines if ln.strip() and not ln.startswith((" ", "\t", "Traceback"))]
        return lines[-1] if lines else "(empty log)"

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await anyio.to_thread.run_sync(self.stop)


def launch_local(cfg: InferenceConfig, model_dir: Path, run_dir: Path) -> LocalServer:
    """The `local` backend's embedded server for a deployment: it requires the configured api key."""
    return LocalServer(model_dir, log_path=run_dir / "logs" / "inference-server.log", max_batch=cfg.max_batch,
                       dtype=cfg.dtype, api_key=cfg.resolved_api_key(), prefix_cache_tokens=cfg.prefix_cache_tokens,
                       attention_window=cfg.attention_window, attention_sinks=cfg.attention_sinks,
                       prefix_cache_int8_tokens=cfg.prefix_cache_int8_tokens, kv_cache=cfg.kv_cache,
                       kv_cache_tokens=cfg.kv_cache_tokens, prefix_cache_disk_tokens=cfg.prefix_cache_disk_tokens,
                       prefix_cache_disk_dir=cfg.prefix_cache_disk_dir, rescore=cfg.rescore)


def launch_sim(cfg: InferenceConfig, model_dir: Path, run_dir: Path) -> LocalServer:
    """The `sim` backend's embedded server: SIMULATED timing and synthetic tokens over the model's tokenizer
    and config (docs/fleet.md); the protocol, weight updates and versions are the real server's."""
    return LocalServer(model_dir, log_path=run_dir / "logs" / "inference-server.log", max_batch=cfg.max_batch,
                       api_key=cfg.resolved_api_key(), backend="sim")


register_inference_backend("local", launch_local, description="the embedded torch server of this project")
register_inference_backend("sim", launch_sim, description="SIMULATED accelerator timing over the SGLang protocol (docs/fleet.md)")
register_inference_backend("sglang", None, needs_model_dir=True,
                           description="external SGLang servers or a router (inference.urls)")
