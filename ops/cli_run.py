"""`rollout run --config FILE [--role ROLE ...]`: a daemon running the configured roles.

Prints one JSON line ``{"event": "ready", "http": URL, "roles": [...]}`` on stdout once every role
is wired. SIGTERM (or a first SIGINT) drains: roles finish or hand back in-flight work, commit and
close, and the process exits 0. A second SIGINT forces an immediate stop (exit 130).

A failure (Kafka or NATS unreachable, a bad model directory, a port in use, a role that keeps crashing)
ends the process with exit code 1 and one line on stderr, ``rollout run: <what, with which settings>``;
the traceback goes to the log at DEBUG level, and to stderr with ``--debug``. The client libraries'
connection retries are not logged while the daemon starts (except with ``--debug``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import traceback

import anyio

from modelserver.model_dir import check_config_model_dir
from engine.config import ROLES, ConfigError, EngineConfig
from ops.deployment import load_deployment_config

log = logging.getLogger("rollout.run")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: built-in defaults + ROLLOUT__* environment)")
    parser.add_argument("--role", action="append", choices=ROLES, dest="roles",
                        help="a role to run in this process; repeat for several (default: the config's roles)")
    parser.add_argument("--run-dir", help="where this process keeps its model, weights and logs (default: runs/<namespace>)")
    parser.add_argument("--instance", help="instance name in heartbeats, metrics and client ids (default: host-pid)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--debug", action="store_true",
                        help="on failure print the traceback too, and keep the client libraries' start-up retry logs")
    parser.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from ops.logs import route_model_library_output, setup_logging

    setup_logging(args.log_level)
    try:
        cfg = load_deployment_config(args.config, files=True)  # the backend names too
        check_config_model_dir(cfg, args.config)
    except ConfigError as exc:
        print(f"rollout run: {exc}", file=sys.stderr)
        return 2
    if {"inference", "learner"} & set(args.roles or cfg.roles):
        route_model_library_output()  # stderr stays JSON lines when models are loaded and weights published
    try:
        return anyio.run(run_daemon, cfg, args.roles, args.run_dir, args.instance, args.debug)
    except Exception as exc:
        if args.debug:
            traceback.print_exception(exc)
        else:
            log.debug("rollout run failed", exc_info=exc)
        print(f"rollout run: {failure_line(exc)}", file=sys.stderr)
        return 1


def failure_line(exc: BaseException) -> str:
    """One line for a failure: the engine's own errors say what and where; anything else also its type."""
    from modelserver.launch import LocalServerError
    from engine.actor import SupervisorGaveUp
    from ops.deployment import StartupError
    from streams.protocols import TransportError  # every transport's errors (Kafka's, NATS's) subclass it

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    text = " ".join(str(exc).split())
    if isinstance(exc, (TransportError, LocalServerError, StartupError, SupervisorGaveUp, ConfigError)):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def run_daemon(cfg: EngineConfig, roles: list[str] | None, run_dir: str | None, instance: str | None,
                     debug: bool = False) -> int:
    from ops.deployment import Deployment
    from ops.logs import quiet

    forced = False
    async with contextlib.AsyncExitStack() as stack:
        with quiet() if debug else quiet("kafka", "nats"):
            deployment = await stack.enter_async_context(Deployment(cfg, roles, run_dir=run_dir, instance=instance))
        print(json.dumps({"event": "ready", "http": deployment.http.url, "roles": deployment.roles,
                          "namespace": cfg.namespace}), flush=True)
        async with anyio.create_task_group() as tg:

            async def on_signals() -> None:
                nonlocal forced
                interrupts = 0
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for sig in signals:
                        if sig == signal.SIGINT:
                            interrupts += 1
                        if interrupts >= 2:
                            log.warning("second SIGINT: stopping without draining")
                            forced = True
                            tg.cancel_scope.cancel()
                            return
                        log.info("%s: draining", signal.Signals(sig).name)
                        deployment.drain()

            tg.start_soon(on_signals)
            await deployment.run()
            tg.cancel_scope.cancel()
    log.info("stopped%s", " (forced)" if forced else "")
    return 130 if forced else 0
