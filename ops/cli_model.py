"""`rollout model prepare NAME` / `rollout model prepare --gguf FILE --out DIR` / `rollout model check DIR`.

``prepare`` writes a Hugging Face model directory and prints its path as the last line of stdout
(progress goes to stderr), so scripts can take ``$(rollout model prepare smollm2-135m | tail -1)``.
A registered model (built in, or added by an installed package's ``rollout_engine.models`` entry point)
is cached under ``<cache_dir>/models`` (``ROLLOUT_CACHE_DIR``, beside the Kafka jars) and preparing it
again returns at once.
"""

from __future__ import annotations

import argparse
import sys


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    sub.required = True
    prepare = sub.add_parser(
        "prepare", help="fetch and convert a model into a cached Hugging Face directory; prints its path last",
        description="Prepare a registered model (see `rollout model list`), or convert a local GGUF of a "
                    "supported architecture (Llama, Qwen2, Mistral) with --gguf FILE --out DIR.")
    prepare.add_argument("name", nargs="?", help="registered model name, e.g. smollm2-135m")
    prepare.add_argument("--gguf", help="a local GGUF file to convert instead of a registered model")
    prepare.add_argument("--out", help="output directory for --gguf (must not exist or be empty)")
    prepare.add_argument("--cache-dir", help="cache root (default: ROLLOUT_CACHE_DIR or ~/.cache/rollout-engine)")
    prepare.set_defaults(func=_prepare)
    listing = sub.add_parser("list", help="the models `prepare` knows, and where each is cached")
    listing.add_argument("--cache-dir", help="cache root (default: ROLLOUT_CACHE_DIR or ~/.cache/rollout-engine)")
    listing.set_defaults(func=_list)
    check = sub.add_parser("check", help="check a model directory (or GGUF file) without loading it")
    check.add_argument("path")
    check.add_argument("--chat-template", action="store_true", help="require a chat template")
    check.add_argument("--min-context", type=int, help="require max_position_embeddings >= this many tokens")
    check.set_defaults(func=_check)


def _log(message: str) -> None:
    print(f"rollout model: {message}", file=sys.stderr, flush=True)


def _prepare(args: argparse.Namespace) -> int:
    from modelserver.model_dir import ModelDirError
    from modelserver.prepare import ModelPrepareError, convert_gguf, prepare_model

    if (args.gguf is None) == (args.name is None):
        print("rollout model prepare: give a model NAME or --gguf FILE --out DIR", file=sys.stderr)
        return 2
    if args.gguf is not None and not args.out:
        print("rollout model prepare: --gguf needs --out DIR", file=sys.stderr)
        return 2
    try:
        if args.gguf is not None:
            path = convert_gguf(args.gguf, args.out, log=_log)
        else:
            path = prepare_model(args.name, args.cache_dir, log=_log)
    except (ModelPrepareError, ModelDirError) as exc:
        print(f"rollout model prepare: {exc}", file=sys.stderr)
        return 1
    sys.stderr.flush()
    print(path.resolve(), flush=True)
    return 0


def _list(args: argparse.Namespace) -> int:
    from modelserver.prepare import MODELS, cached_model_dir

    for name in MODELS.names():  # built in, and those installed packages add (entry points)
        path = cached_model_dir(name, args.cache_dir)
        state = "prepared" if path.is_dir() else "not prepared"
        print(f"{name}\t{state}\t{path}\t{MODELS[name].description}")
    for name, why in sorted(MODELS.unavailable_names().items()):
        print(f"{name}\tunavailable\t-\t{why}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from modelserver.model_dir import ModelDirError, check_model_dir

    try:
        config = check_model_dir(args.path, need_chat_template=args.chat_template, min_context=args.min_context)
    except ModelDirError as exc:
        print(f"rollout model check: {exc}", file=sys.stderr)
        return 1
    print(f"{args.path}: ok ({', '.join(config['architectures'])}, "
          f"{config.get('max_position_embeddings', '?')} positions)")
    return 0
