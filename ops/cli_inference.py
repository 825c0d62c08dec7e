"""`rollout inference serve`: run the local SGLang-protocol inference server.

Once the socket listens, one JSON line goes to stdout: ``{"event": "listening", "host": ..., "port": ...,
"url": ...}`` (so ``--port 0`` is usable: read the line, then poll ``/health_generate`` until 200).

The api key (SGLang's ``--api-key``) comes from ``--api-key-file``, ``--api-key`` or the environment
variable ``ROLLOUT__INFERENCE__API_KEY`` (the one ``inference.api_key`` reads, so one secret serves the
server and its clients); without one the server listens on loopback only. Prefer the file or the
variable: a command line is visible to every user of the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from engine.config import INFERENCE_API_KEY_ENV as API_KEY_ENV

if TYPE_CHECKING:
    from modelserver.local.engine import Rescorer


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="inference_command", metavar="SUBCOMMAND")
    sub.required = True
    serve = sub.add_parser("serve", help="serve a causal LM over SGLang's native HTTP API (CPU, torch)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=30000, help="port to bind; 0 picks a free one (default: 30000)")
    serve.add_argument(
        "--model-dir", default=None, help="HF model directory; default: a tiny seeded model built in a temp dir"
    )
    serve.add_argument("--max-batch", type=int, default=32, help="most sequences decoded together (default: 32)")
    serve.add_argument(
        "--chunk-size", type=int, default=512, help="prefill tokens per scheduler step, all prompts together (default: 512)"
    )
    serve.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                       help="serving dtype of weights and KV cache; logprobs stay fp32 (default: fp32)")
    serve.add_argument("--prefix-cache-tokens", type=int, default=8192,
                       help="tokens of finished sequences' KV kept for reuse by later prompts with the same prefix; "
                            "0 disables (default: 8192)")
    serve.add_argument("--prefix-cache-int8-tokens", type=int, default=0,
                       help="a second, int8-compressed tier of the prefix cache: tokens evicted from the first are "
                            "quantised and kept this many more; 0: none (default: 0)")
    serve.add_argument("--prefix-cache-disk-tokens", type=int, default=0,
                       help="a third tier on disk below the int8 one: tokens it evicts are written (still int8, a "
                            "file each) and kept this many more; needs --prefix-cache-int8-tokens; 0: none (default: 0)")
    serve.add_argument("--prefix-cache-disk-dir",
                       help="directory in which the disk tier makes its own (removed at exit; default: the system's "
                            "temporary directory)")
    serve.add_argument("--kv-cache", choices=["paged", "slot"], default="paged",
                       help="KV store: paged (fixed-size blocks, a block table per sequence, shared prefix blocks, "
                            "a radix tree of retained prefixes) or slot (a preallocated row per sequence) "
                            "(default: paged)")
    serve.add_argument("--kv-cache-tokens", type=int, default=65536,
                       help="paged: the KV pool's bound in tokens (memory: this x the KV bytes per token); a request "
                            "waits until its worst case (input + max_new_tokens) fits (default: 65536)")
    serve.add_argument("--kv-block-size", type=int, default=16, help="paged: tokens per KV block (default: 16)")
    serve.add_argument("--attention-window", type=int, default=None,
                       help="sliding-window attention over the last N positions (default: full attention)")
    serve.add_argument("--attention-sinks", type=int, default=0,
                       help="with --attention-window: first positions always attended to (default: 0)")
    serve.add_argument("--rescore", action=argparse.BooleanOptionalAction, default=False,
                       help="re-score each finished sample with one full-sequence forward, the learner's own "
                            "computation, so same-version logprobs equal the learner's (docs/learner.md; default: off)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the generated tiny model (default: 0)")
    serve.add_argument("--weight-version", default="default", help="initial weight version (default: 'default')")
    serve.add_argument(
        "--torch-threads", type=int, default=0, help="torch intra-op threads; 0 keeps torch's default (default: 0)"
    )
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: ${API_KEY_ENV}; "
                            "needed to listen beyond loopback)")
    serve.add_argument("--api-key-file", default=None, help="read the api key from this file (whitespace stripped)")
    serve.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                       help="leave the loaded heap in the garbage collector's reach (default: frozen once loaded)")
    serve.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    serve.add_argument("--backend", choices=("local", "sim"), default="local",
                       help="local: a real torch model; sim: SIMULATED roofline timing, synthetic tokens (docs/fleet.md)")
    serve.add_argument("--time-scale", type=float, default=1.0,
                       help="sim backend: wall seconds per simulated second (default: 1.0)")
    serve.set_defaults(func=_serve)
    cal = sub.add_parser("calibrate-sim", help="fit the sim backend's roofline to the local engine's timings on this CPU")
    cal.add_argument("--model-dir", required=True, help="HF model directory the local engine runs")
    cal.add_argument("--quick", action="store_true", help="fewer measurement points")
    cal.add_argument("--json", default=None, help="write the result here")
    cal.set_defaults(func=_calibrate_sim)


def _calibrate_sim(args: argparse.Namespace) -> int:
    from modelserver.sim.calibrate import main
    from modelserver.model_dir import ModelDirError, check_model_dir

    try:
        check_model_dir(args.model_dir)
    except ModelDirError as exc:
        print(f"rollout inference calibrate-sim: --model-dir: {exc}", file=sys.stderr)
        return 2
    return main(["--model-dir", args.model_dir, *(["--quick"] if args.quick else []), *(["--json", args.json] if args.json else [])])


def _serve(args: argparse.Namespace) -> int:
    from modelserver.local.server import InsecureBindError, ModelLoadError, ServerConfig, is_loopback, serve

    if args.max_batch < 1 or args.chunk_size < 1:
        print("rollout inference serve: --max-batch and --chunk-size must be at least 1", file=sys.stderr)
        return 2
    if args.prefix_cache_tokens < 0:
        print(f"rollout inference serve: --prefix-cache-tokens must be >= 0, got {args.prefix_cache_tokens}",
              file=sys.stderr)
        return 2
    if args.prefix_cache_int8_tokens < 0:
        print(f"rollout inference serve: --prefix-cache-int8-tokens must be >= 0, got {args.prefix_cache_int8_tokens}",
              file=sys.stderr)
        return 2
    if args.prefix_cache_disk_tokens < 0 or (args.prefix_cache_disk_tokens and not args.prefix_cache_int8_tokens):
        print(f"rollout inference serve: --prefix-cache-disk-tokens must be >= 0 and needs --prefix-cache-int8-tokens "
              f"(the disk tier holds what the int8 tier evicts), got {args.prefix_cache_disk_tokens} with "
              f"--prefix-cache-int8-tokens {args.prefix_cache_int8_tokens}", file=sys.stderr)
        return 2
    if args.prefix_cache_disk_dir is not None and not Path(args.prefix_cache_disk_dir).is_dir():
        print(f"rollout inference serve: --prefix-cache-disk-dir {args.prefix_cache_disk_dir} is not a directory",
              file=sys.stderr)
        return 2
    if args.kv_block_size < 1 or args.kv_cache_tokens < args.kv_block_size:
        print(f"rollout inference serve: --kv-block-size must be >= 1 and --kv-cache-tokens at least one block, got "
              f"--kv-block-size {args.kv_block_size} --kv-cache-tokens {args.kv_cache_tokens}", file=sys.stderr)
        return 2
    if args.attention_window is not None and args.attention_window < 1:
        print(f"rollout inference serve: --attention-window must be at least 1, got {args.attention_window}",
              file=sys.stderr)
        return 2
    if args.attention_sinks < 0:
        print(f"rollout inference serve: --attention-sinks must be >= 0, got {args.attention_sinks}", file=sys.stderr)
        return 2
    if args.model_dir is not None:
        from modelserver.model_dir import ModelDirError, check_model_dir

        try:  # before torch loads anything: a bad directory is named with the file and what is wrong
            check_model_dir(args.model_dir)
        except ModelDirError as exc:
            print(f"rollout inference serve: --model-dir: {exc}", file=sys.stderr)
            return 2
    try:
        api_key = _api_key(args)
    except ValueError as exc:
        print(f"rollout inference serve: {exc}", file=sys.stderr)
        return 2
    if not api_key and not is_loopback(args.host):  # before the model loads: fail fast
        print(f"rollout inference serve: {InsecureBindError(args.host)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        model_dir=args.model_dir,
        max_batch=args.max_batch,
        chunk_size=args.chunk_size,
        dtype=args.dtype,
        prefix_cache_tokens=args.prefix_cache_tokens,
        prefix_cache_int8_tokens=args.prefix_cache_int8_tokens,
        prefix_cache_disk_tokens=args.prefix_cache_disk_tokens,
        prefix_cache_disk_dir=args.prefix_cache_disk_dir,
        kv_cache=args.kv_cache,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_block_size=args.kv_block_size,
        attention_window=args.attention_window,
        attention_sinks=args.attention_sinks,
        seed=args.seed,
        weight_version=args.weight_version,
        gc_freeze=args.gc_freeze,
        api_key=api_key,
        rescore=_rescorer() if args.rescore else None,
    )

    def announce(host: str, port: int) -> None:
        line = {"event": "listening", "host": host, "port": port, "url": f"http://{host}:{port}"}
        print(json.dumps(line), flush=True)

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        # SIGTERM drains like Ctrl-C: the server task is cancelled and cleans up (aborts, temp model dir).
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        if args.backend == "sim":
            from modelserver.sim.server import SimOptions, serve_sim

            await serve_sim(config, SimOptions(time_scale=args.time_scale), on_bound=announce)
            return
        await serve(config, on_bound=announce)

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    except ModelLoadError as exc:  # the traceback is already logged above
        print(f"rollout inference serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _rescorer() -> Rescorer:
    """The learner's own scoring (``learning.core.score_tokens``): the server re-scores finished samples with it."""
    from learning.core import score_tokens

    return score_tokens


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or the environment (in that order); empty means none."""
    if args.api_key_file is not None and args.api_key is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        from engine.config import read_key_file

        return read_key_file(args.api_key_file, "--api-key-file")  # a ConfigError is a ValueError
    return args.api_key or os.environ.get(API_KEY_ENV) or None
