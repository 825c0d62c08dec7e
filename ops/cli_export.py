"""`rollout export --config C --out F.jsonl`: trajectories from the experience log to JSONL or Parquet (resumable)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="the deployment's TOML config (Kafka and namespace)")
    parser.add_argument("--out", required=True, help="output JSONL; <out>.position.json beside it resumes")
    parser.add_argument("--domain", action="append", default=[], help="keep only this domain (repeatable)")
    parser.add_argument("--min-reward", type=float)
    parser.add_argument("--max-reward", type=float)
    parser.add_argument("--min-version", type=int, help="oldest weight version of the sample's tokens")
    parser.add_argument("--max-version", type=int)
    parser.add_argument("--since-ms", type=int, help="record timestamp lower bound (ms since the epoch)")
    parser.add_argument("--until-ms", type=int)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl",
                        help="jsonl: one file; parquet: --out is a directory of part files")
    parser.add_argument("--idle-s", type=float, default=3.0, help="stop after this long with no new record")
    parser.add_argument("--sft", action="store_true",
                        help='SFT view: {"messages": [...]} of the successful trajectories only')
    parser.add_argument("--sft-min-reward", type=float,
                        help="with --sft: success is reward >= this (default: fully solved, correctness 1)")
    parser.add_argument("--tokenizer", help="with --sft: the model directory whose tokenizer decodes the token ids "
                                            "(default: the config's inference.model_dir)")
    parser.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    import anyio

    from actors.export import ExportError, ExportFilter, export_jsonl, export_parquet
    from engine.config import ConfigError, load_config
    from engine.topics import Names

    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as exc:
        print(f"rollout export: {exc}", file=sys.stderr)
        return 2
    flt = ExportFilter(domains=frozenset(args.domain), min_reward=args.min_reward, max_reward=args.max_reward,
                       min_version=args.min_version, max_version=args.max_version, since_ms=args.since_ms,
                       until_ms=args.until_ms)
    topic = Names(cfg.namespace).experience
    sft = None
    if (args.sft_min_reward is not None or args.tokenizer) and not args.sft:
        print("rollout export: --sft-min-reward and --tokenizer go with --sft", file=sys.stderr)
        return 2
    if args.sft:
        tokenizer_dir = args.tokenizer or cfg.inference.model_dir
        if not tokenizer_dir:
            print("rollout export: --sft needs a tokenizer: give --tokenizer DIR or set inference.model_dir",
                  file=sys.stderr)
            return 2
        from transformers import AutoTokenizer

        from actors.export import SftView

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except Exception as exc:  # transformers raises several types for a directory without a tokenizer
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"rollout export: cannot load a tokenizer from {tokenizer_dir}: {first}", file=sys.stderr)
            return 2
        sft = SftView(tokenizer, args.sft_min_reward)
    exporter = export_parquet if args.format == "parquet" else export_jsonl
    try:
        read, written = anyio.run(lambda: exporter(cfg.kafka, topic, Path(args.out), flt, idle_s=args.idle_s, sft=sft))
    except ExportError as exc:
        print(f"rollout export: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out}: {written} {'SFT conversations' if sft else 'rows'} written ({read} records read from {topic})")
    return 0
