"""One process of a deployment: the configured roles, their shared resources, one supervisor.

    async with Deployment(cfg, roles=["sandbox", "reward"]) as d:
        await d.run()                # until drained (SIGTERM) or every role is done

This is the only place that knows how the roles are built; the roles know nothing of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from engine.actor import Actor, RestartPolicy, Supervisor
from engine.config import ROLES, ConfigError, EngineConfig, load_config

log = logging.getLogger("rollout.deployment")


class StartupError(RuntimeError):
    """Something the deployment needs before it can start is missing; the message names the setting."""


def ensure_model_dir(cfg: EngineConfig, run_dir: Path) -> Path:
    """The HF model directory the local backend serves and the learner starts from.

    With no ``inference.model_dir``, a tiny model is built from a config (deterministic in the
    learner seed, so every machine of a deployment builds the same one).
    """
    if cfg.inference.model_dir:
        return Path(cfg.inference.model_dir)
    from modelserver.llm import write_tiny_model_dir

    path = run_dir / "model"
    if not (path / "config.json").exists():
        write_tiny_model_dir(path, seed=cfg.learner.seed)
    return path


def backend_errors(cfg: EngineConfig) -> list[tuple[str, str]]:
    """What the config's backend names get wrong, as ``(field, message)``; empty when every name is usable.

    Checked here, where the deployment is wired, not in engine/config.py: the registries belong to the
    packages above the engine (modelserver/, sandboxes/), and a name a plugin registers must be accepted.
    """
    from modelserver.backends import inference_backend
    from sandboxes.registry import sandbox_backend

    errors: list[tuple[str, str]] = []
    inference = cfg.inference
    try:
        backend = inference_backend(inference.backend)  # ValueError naming the registered backends
    except ValueError as exc:
        errors.append(("inference.backend", str(exc)))
    else:
        if not inference.urls and backend.launch is None:
            errors.append(("inference.urls", f"backend {inference.backend!r} needs the URLs of its servers or "
                                             "router (it starts none of its own)"))
        if inference.model_dir is None and backend.needs_model_dir:
            errors.append(("inference.model_dir", f"backend {inference.backend!r} needs the model directory its "
                           "servers serve (the directory they were started with, e.g. SGLang's `--model-path`): "
                           "the learner starts from it and the inference actor tokenizes with it; set "
                           "inference.model_dir"))
    try:
        sandbox_backend(cfg.sandbox.backend)
    except ValueError as exc:
        errors.append(("sandbox.backend", str(exc)))
    return errors


def load_deployment_config(path: str | Path | None = None, **kwargs: Any) -> EngineConfig:
    """:func:`engine.config.load_config` for a process that runs roles: the backend names are checked too.

    Raises ConfigError naming the file and the field (``deploy.toml: inference.backend: unknown ...``).
    """
    return load_config(path, checks=(backend_errors,), **kwargs)


def check_backends(cfg: EngineConfig) -> None:
    """:func:`backend_errors` of a config built in code (not loaded from a file): ConfigError, one line each."""
    errors = backend_errors(cfg)
    if errors:
        raise ConfigError("\n".join(f"{field}: {message}" for field, message in errors))


def load_plugins(cfg: EngineConfig) -> None:
    """Load the config's domain plugins (``[domains] plugins``) before any role looks a domain up.

    Raises :class:`StartupError` naming the plugin that fails to load.
    """
    from domains import load_domain_plugins
    from engine.registry import PluginError

    try:
        load_domain_plugins(cfg.domains.plugins)
    except PluginError as exc:
        raise StartupError(f"domains.plugins: {exc}") from exc


class Deployment:
    def __init__(self, cfg: EngineConfig, roles: list[str] | None = None, *, run_dir: str | Path | None = None,
                 instance: str | None = None, extra_actors: list[tuple[str, Callable[[], Actor]]] | None = None) -> None:
        self.cfg = cfg
        self.roles = list(roles or cfg.roles)
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown role(s) {sorted(unknown)}; roles are {list(ROLES)}")
        self.run_dir = Path(run_dir or Path("runs") / cfg.namespace)
        self.instance = instance
        self.extra_actors = extra_actors or []
        sup = cfg.supervision
        self.supervisor = Supervisor(
            RestartPolicy(max_restarts=sup.max_restarts, restart_window_s=sup.restart_window_s,
                          backoff_initial_s=sup.backoff_initial_s, backoff_max_s=sup.backoff_max_s),
            drain_timeout_s=sup.drain_timeout_s)
        self.rt: Any = None
        self.http: Any = None
        self.heartbeater: Any = None
        self.recorder: Any = None
        self.model_dir: Path | None = None
        self.inference_urls: list[str] = []
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "Deployment":
        try:
            load_plugins(self.cfg)
            check_backends(self.cfg)  # after the plugins: they may register backends
            await self._wire()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _wire(self) -> None:
        from actors.runtime import Runtime
        from ops.http import HttpServer

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._check_model_dir()
        self._setup_tracing()
        enter = self._stack.enter_async_context
        self.rt = rt = await enter(Runtime(self.cfg, instance=self.instance))
        add = self.supervisor.add

        if "inference" in self.roles or "learner" in self.roles:
            self.model_dir = ensure_model_dir(self.cfg, self.run_dir)

        if "sandbox" in self.roles:
            from actors.sandbox import build_sandbox_actors, sandbox_resources

            resources = await enter(sandbox_resources(self.cfg.sandbox))
            for spec in build_sandbox_actors(rt, resources):  # episodes drain after inference, if it runs here
                self.supervisor.add_spec(spec)

        if "inference" in self.roles:
            from transformers import AutoTokenizer

            from actors.inference.actor import InferenceActor
            from modelserver.backends import inference_backend

            assert self.model_dir is not None
            urls = list(self.cfg.inference.urls)
            if not urls:
                launch = inference_backend(self.cfg.inference.backend).launch
                if launch is None:
                    raise ValueError(f"inference.backend = {self.cfg.inference.backend!r} needs inference.urls "
                                     "(it starts no server of its own)")
                urls = [await enter(launch(self.cfg.inference, Path(self.model_dir), self.run_dir))]
            self.inference_urls = urls
            tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            add("inference", lambda: InferenceActor(rt, urls, tokenizer,
                                                    reply_partition=self.cfg.inference.reply_partition,
                                                    weights_dir=self.run_dir / "weights"))
            if self.cfg.eval.every_versions:
                from actors.eval_role import EvalActor

                add("eval", lambda: EvalActor(rt, urls, tokenizer, self.cfg.eval, sandbox_backend=self.cfg.sandbox.backend,
                                              api_key=self.cfg.inference.resolved_api_key()))

        if "reward" in self.roles:
            from actors.reward import RewardActor

            add("reward", lambda: RewardActor(rt))

        if "learner" in self.roles:
            from actors.learner import LearnerActor

            # the weights canary probes the servers this deployment started, or inference.urls; a simulated
            # server's synthetic logprobs say nothing about its weights
            probe = (list(self.inference_urls) if self.inference_urls and self.cfg.inference.backend != "sim"
                     else [] if self.cfg.inference.backend == "sim" else None)
            add("learner", lambda: LearnerActor(rt, model_dir=str(self.model_dir), probe_urls=probe))

        if "scheduler" in self.roles:
            from actors.scheduler import SchedulerActor

            add("scheduler", lambda: SchedulerActor(rt))

        for name, factory in self.extra_actors:
            add(name, factory)

        from ops.dashboard import Recorder, dashboard_routes
        from ops.heartbeat import Heartbeater, LagCollector

        tel = self.cfg.telemetry
        self.heartbeater = Heartbeater(rt, self.supervisor, tel.heartbeat_s)
        self.recorder = Recorder.from_supervisor(self.supervisor, lag=lambda: self.heartbeater.lag)
        try:
            self.http = await enter(HttpServer(tel.http_host, tel.http_port, self.supervisor,
                                               control_token=tel.control_token,
                                               extra_routes=lambda app: dashboard_routes(app, self.recorder)))
        except OSError as exc:
            raise StartupError(f"cannot listen on telemetry.http_host:http_port = {tel.http_host}:{tel.http_port}: "
                               f"{exc.strerror or exc}") from exc
        self.http.registry.register(LagCollector(self.heartbeater, self.supervisor))
        log.info("deployment %s: roles %s; http %s", self.cfg.namespace, self.roles, self.http.url)
        if self.cfg.supervision.gc_freeze:
            from engine.process import freeze_startup_heap

            freeze_startup_heap()

    def _check_model_dir(self) -> None:
        """Refuse a configured model directory that plainly cannot be loaded, before connecting to anything."""
        model_dir = self.cfg.inference.model_dir
        if not model_dir or not {"inference", "learner"} & set(self.roles):
            return
        from modelserver.model_dir import ModelDirError, check_model_dir

        try:
            check_model_dir(model_dir)
        except ModelDirError as exc:
            raise StartupError(f"inference.model_dir = {model_dir}: {exc}") from None

    def _setup_tracing(self) -> None:
        """Install this process's span exporter (if ``telemetry.tracing``); flushed when the deployment closes."""
        from ops.telemetry import setup_tracing

        service = f"rollout-{self.roles[0]}" if len(self.roles) == 1 else "rollout"
        instance = self.instance or f"{socket.gethostname()}-{os.getpid()}"
        # registered first, so it runs last: spans ended while the roles shut down are exported too
        self._stack.callback(setup_tracing(self.cfg.telemetry, service, resource_attributes={
            "service.namespace": self.cfg.namespace, "service.instance.id": instance,
            "rollout.roles": ",".join(self.roles)}))

    async def run(self) -> None:
        """Run every role until drained or done; raises SupervisorGaveUp if a role keeps crashing."""
        async with anyio.create_task_group() as tg:
            if self.rt.control is not None:
                tg.start_soon(self.heartbeater.run)
            tg.start_soon(self.recorder.run)
            await self.supervisor.run()
            tg.cancel_scope.cancel()

    def drain(self) -> None:
        self.supervisor.drain()
