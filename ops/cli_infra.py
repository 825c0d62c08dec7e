"""`rollout infra up|down|status`: the local Kafka broker, nats-server, Docker engine and bubblewrap."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from pathlib import Path

from ops.infra import InfraConfig, InfraError, Stack, format_table


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="infra_command", metavar="ACTION")
    sub.required = True

    up = sub.add_parser("up", help="start what is not running and wait until it answers (idempotent)")
    _common(up)
    up.add_argument("--docker", action="store_true", help="also run a Docker engine (installs docker.io if missing)")
    up.add_argument("--bwrap", action="store_true", help="also check bubblewrap (installs it if missing)")
    up.add_argument("--jaeger", action="store_true",
                    help="also run a local Jaeger v2 for traces (built with Go on first use; prints the OTLP endpoint)")
    up.add_argument("--jaeger-otlp-port", type=int, help="Jaeger's OTLP/HTTP port (env ROLLOUT_JAEGER_OTLP_PORT, default 4318)")
    up.add_argument("--jaeger-port", type=int, help="Jaeger's UI/query port (env ROLLOUT_JAEGER_PORT, default 16686)")
    up.add_argument("--kafka-port", type=int, help="Kafka client port (env ROLLOUT_KAFKA_PORT, default 9092)")
    up.add_argument(
        "--kafka-controller-port", type=int, help="KRaft controller port (env ROLLOUT_KAFKA_CONTROLLER_PORT, default 9093)"
    )
    up.add_argument("--nats-port", type=int, help="NATS client port (env ROLLOUT_NATS_PORT, default 4222)")
    up.add_argument("--kafka-heap", help="broker JVM heap options (env ROLLOUT_KAFKA_HEAP, default '-Xmx1G -Xms512m')")
    up.add_argument("--docker-socket", type=Path, help="Docker API socket (env ROLLOUT_DOCKER_SOCKET)")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop what `up` started in this state dir (by pid), nothing else")
    _common(down)
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help="table of services; exits 1 if an expected one is down")
    _common(status)
    status.set_defaults(func=_status)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, help="pid files, logs and data (env ROLLOUT_STATE_DIR, default .state/infra)")


RECORDED = "infra.json"
"""What ``up`` started with (ports, heap, socket), in the state dir: ``down`` and ``status`` of that
state dir use it, so a stack started on other ports is still found."""
_RECORDED_FIELDS = ("kafka_port", "kafka_controller_port", "nats_port", "kafka_heap", "docker_socket",
                    "jaeger_otlp_port", "jaeger_port")


def _config(args: argparse.Namespace) -> InfraConfig:
    given = {f: getattr(args, f, None) for f in _RECORDED_FIELDS}
    base = InfraConfig.from_env(state_dir=args.state_dir)
    recorded_path = base.state_dir / RECORDED
    recorded: dict[str, object] = {}
    if recorded_path.is_file():
        try:
            recorded = {k: v for k, v in json.loads(recorded_path.read_text()).items() if k in _RECORDED_FIELDS}
        except (OSError, ValueError) as exc:
            raise InfraError(f"cannot read {recorded_path} ({exc}); delete it if the stack there is gone") from None
    # flags given now win, then what `up` recorded for this state dir, then the environment
    overrides: dict[str, Any] = {f: given[f] if given[f] is not None else recorded.get(f) for f in _RECORDED_FIELDS}
    return InfraConfig.from_env(state_dir=base.state_dir, **overrides)


def _record(config: InfraConfig) -> None:
    config.state_dir.mkdir(parents=True, exist_ok=True)
    values = {f: getattr(config, f) for f in _RECORDED_FIELDS}
    values["docker_socket"] = str(values["docker_socket"])
    (config.state_dir / RECORDED).write_text(json.dumps(values, indent=2) + "\n")


def _fail(exc: InfraError) -> int:
    print(f"rollout infra: {exc}", file=sys.stderr)
    if exc.log_tail:
        print(f"--- last log lines ---\n{exc.log_tail}", file=sys.stderr)
    return 1


def _up(args: argparse.Namespace) -> int:
    try:
        config = _config(args)
        _record(config)
        stack = Stack(config, docker=args.docker, bwrap=args.bwrap, jaeger=args.jaeger)
        rows = stack.up(log=lambda line: print(line, flush=True))
    except InfraError as exc:
        return _fail(exc)
    print(format_table(rows))
    if stack.docker:
        print(f"export DOCKER_HOST={stack.config.docker_host}")
    if stack.jaeger:
        print(f"export OTEL_EXPORTER_OTLP_ENDPOINT={stack.jaeger_server.otlp_endpoint}   "
              f"# and telemetry.tracing = true; traces at {stack.jaeger_server.query_url}")
    return 0 if all(r.healthy for r in rows) else 1


def _down(args: argparse.Namespace) -> int:
    try:
        Stack(_config(args)).down(log=lambda line: print(line, flush=True))
    except InfraError as exc:
        return _fail(exc)
    return 0


def _status(args: argparse.Namespace) -> int:
    try:
        rows = Stack(_config(args)).status()
    except InfraError as exc:
        return _fail(exc)
    print(format_table(rows))
    return 0 if all(r.healthy for r in rows) else 1
