"""`rollout demo`: the main job, a short real RL run on the local stack (see ops/demo.py).

Needs Kafka and NATS running (`rollout infra up --bwrap`); `make demo` does both.
"""

from __future__ import annotations

import argparse
import os


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a TOML deployment config instead of the demo's built-in one")
    parser.add_argument("--run-dir", default="runs/demo", help="model, checkpoints, logs, results (default: runs/demo)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="model to train: a preparable name (default smollm2-135m, prepared on first use) or "
                             "'tiny' (the seeded character-level fixture, with a supervised warm start)")
    parser.add_argument("--model-dir", help="train this HF model directory instead of the prepared --model")
    parser.add_argument("--seconds", type=float, default=780.0,
                        help="wall-clock budget of the real model's RL run (default: 780, the learning benchmark's)")
    parser.add_argument("--steps", type=int, help="learner steps of the RL run (default: tiny 60; real: the --seconds budget)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, tasks and held-out sets")
    parser.add_argument("--sft-steps", type=int, help="optimizer steps of the supervised warm start (default: the plan's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: short RL, small held-out sets")
    parser.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
                        help="Kafka bootstrap servers (default: $ROLLOUT_KAFKA_BOOTSTRAP or 127.0.0.1:9092)")
    parser.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL", "nats://127.0.0.1:4222"),
                        help="NATS URL (default: $ROLLOUT_NATS_URL or nats://127.0.0.1:4222)")
    parser.add_argument("--log-level", default="WARNING")
    parser.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from ops.demo import main_sync
    from ops.infra.kafka_broker import kafka_answers_metadata
    from ops.infra.nats_server import nats_jetstream_answers
    from ops.logs import setup_logging

    setup_logging(args.log_level, json_lines=False)
    if not kafka_answers_metadata(args.bootstrap, timeout_s=5):
        print(f"rollout demo: no Kafka broker answers at {args.bootstrap}; start one with `rollout infra up --bwrap`")
        return 2
    if not nats_jetstream_answers(args.nats, timeout_s=5):
        print(f"rollout demo: no nats-server with JetStream answers at {args.nats}; start one with `rollout infra up`")
        return 2
    return main_sync(args)
