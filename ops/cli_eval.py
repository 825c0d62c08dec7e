"""`rollout eval`: a fixed policy on held-out task sets, through the same sandboxes and verifiers as training.

The policy is a model directory (served here by the embedded `local` backend, as a deployment starts
it) or any SGLang-protocol URL. The tasks are built-in domains' held-out tasks (``--domain math=64``)
and/or a user's task file (``--tasks FILE``, read by :mod:`engine.tasks` like the scheduler reads it).
Per domain it reports the task completion rate (fraction of episodes fully solved) with a 95% Wilson
interval, mean correctness, pass@1 and pass@K (unbiased) each with a 95% interval over the tasks, mean
turns and generated tokens: a table on stdout, ``--json F`` (with every episode) and ``--markdown F``.
A benchmark file is read as its benchmark ships it (``--tasks HumanEval.jsonl.gz``; see docs/tasks.md).

Exit codes: 0 done, 2 bad input (unknown domain, unreadable task file, bad option), 1 the policy could
not be reached or served. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

PROG = "rollout eval"


class EvalInputError(ValueError):
    """Bad input (exit code 2); the message names what was wrong."""


class PolicyError(RuntimeError):
    """The policy cannot be reached or served (exit code 1)."""


def register(parser: argparse.ArgumentParser) -> None:
    policy = parser.add_mutually_exclusive_group(required=True)
    policy.add_argument("--model-dir", help="serve this model directory with the embedded local server")
    policy.add_argument("--url", help="any SGLang-protocol server (e.g. http://127.0.0.1:30000)")
    policy.add_argument("--checkpoint", metavar="DIR",
                        help="a learner checkpoint (step-*-v*/), or a checkpoint directory (its newest is taken)")
    policy.add_argument("--weights", metavar="CONFIG",
                        help="the weight version the learner of the deployment configured by CONFIG last published "
                             "on NATS (with its inference.model_dir's config and tokenizer)")
    parser.add_argument("--tokenizer", help="with --url: the served model's directory, for its chat template "
                                            "(default: prompts are sent as raw text)")
    parser.add_argument("--domain", action="append", default=[], metavar="NAME=N",
                        help="N held-out tasks of built-in domain NAME (repeatable), e.g. --domain math=64")
    parser.add_argument("--tasks", metavar="FILE", help="a user's task file (JSONL, Parquet or saved HF dataset dir)")
    parser.add_argument("--map", action="append", default=[], metavar="FIELD=COLUMN",
                        help="with --tasks: read task FIELD from the file's COLUMN, a constant (FIELD=const:VALUE) "
                             "or a template of columns (FIELD='{question}\\n{hint}') (repeatable)")
    parser.add_argument("--tasks-domain", help="with --tasks: the domain of rows that name none")
    parser.add_argument("--limit", type=int, metavar="N", help="with --tasks: only the file's first N tasks")
    parser.add_argument("--samples", type=int, default=1, help="generations per task (K of pass@K; default 1)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default 0 = greedy for --samples 1, else 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="held-out draw and sampling seed (default 0)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="generation budget of domains that set none (default 32)")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight (default 16)")
    parser.add_argument("--request-timeout", type=float, default=120.0, metavar="S",
                        help="seconds one generation request may take, queueing included (default 120; raise it for "
                             "long budgets on a CPU)")
    parser.add_argument("--sandbox-backend", default="bwrap", choices=("bwrap", "docker"),
                        help="where verifiers and multi-turn episodes run (default bwrap)")
    parser.add_argument("--json", metavar="F", help="write the report and every episode as JSON")
    parser.add_argument("--markdown", metavar="F", help="write the report as a Markdown table")
    parser.set_defaults(func=_eval)


def _domain_counts(pairs: list[str]) -> dict[str, int]:
    from domains import DOMAINS

    out: dict[str, int] = {}
    for pair in pairs:
        name, sep, count = pair.partition("=")
        if not sep or not name or not count.isdigit() or int(count) < 1:
            raise EvalInputError(f"--domain wants NAME=N with N >= 1, got {pair!r}")
        try:
            DOMAINS[name]  # resolves families (rg:NAME); the error says why (unknown, or unavailable here)
        except KeyError as exc:
            raise EvalInputError(f"--domain {pair}: {exc}") from None
        out[name] = int(count)
    return out


def load_tasks(args: argparse.Namespace) -> list[Any]:
    """The task set the arguments name: held-out tasks of each ``--domain``, then the ``--tasks`` file's rows."""
    from actors.evaluate import file_tasks, heldout_tasks
    from engine.tasks import TaskFileError, parse_mapping

    if not args.domain and not args.tasks:
        raise EvalInputError("nothing to evaluate: give --domain NAME=N and/or --tasks FILE")
    try:
        tasks = heldout_tasks(_domain_counts(args.domain), seed=args.seed) if args.domain else []
    except ValueError as exc:  # a domain that cannot draw held-out tasks (a file-only one, a missing package)
        raise EvalInputError(str(exc)) from None
    if args.tasks:
        try:
            rows = file_tasks(args.tasks, default_domain=args.tasks_domain, mapping=parse_mapping(args.map))
        except (TaskFileError, ValueError) as exc:
            raise EvalInputError(str(exc)) from None
        tasks += rows[:args.limit] if args.limit else rows
    if not tasks:
        raise EvalInputError("the task set is empty (the domains' held-out spaces gave no task)")
    return tasks


async def _check_url(url: str) -> None:
    from modelserver.client import SGLangClient

    try:
        async with SGLangClient([url], timeout=10, retries=0) as client:
            healthy = await client.health_generate()
    except Exception as exc:  # connection refused, bad URL, DNS: all mean "cannot reach the policy"
        raise PolicyError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if not healthy:
        raise PolicyError(f"cannot reach {url}: /health_generate did not answer 200 (is an SGLang-protocol server there?)")


async def run_eval(args: argparse.Namespace, tasks: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Serve or reach the policy, play every task, return (reports per domain, episode records)."""
    from actors.evaluate import run_episodes, summarise

    kwargs = dict(seed=args.seed, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                  samples=args.samples, temperature=args.temperature, sandbox_backend=args.sandbox_backend,
                  request_timeout_s=args.request_timeout)
    if args.url:
        await _check_url(args.url)
        tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
        records = await run_episodes(args.url, tasks, tokenizer=tokenizer, **kwargs)  # type: ignore[arg-type]
    else:
        with tempfile.TemporaryDirectory(prefix="rollout-eval-") as scratch:
            model_dir = await policy_dir(args, Path(scratch))
            records = await _serve_and_play(model_dir, tasks, kwargs)
    return summarise(records, args.samples), records


async def _run_or_policy_error(args: argparse.Namespace, tasks: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """:func:`run_eval`, a policy that stops answering mid-run (a request timing out, a dropped connection) as
    a :class:`PolicyError` naming the first failure."""
    from modelserver.client import SGLangError

    try:
        return await run_eval(args, tasks)
    except BaseException as exc:
        failures = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        first = next((e for e in _leaves(failures) if isinstance(e, SGLangError)), None)
        if first is None:
            raise
        raise PolicyError(f"the policy stopped answering: {first} (--request-timeout {args.request_timeout:g} s; "
                          "raise it or lower --concurrency for long budgets on a slow server)") from None


def _leaves(excs: Any) -> list[BaseException]:
    out: list[BaseException] = []
    for e in excs:
        out += _leaves(e.exceptions) if isinstance(e, BaseExceptionGroup) else [e]
    return out


async def policy_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """The model directory to serve: --model-dir, a checkpoint's model, or the latest weights on NATS."""
    if args.checkpoint:
        from actors.learner_checkpoint import CheckpointStore

        ckpt = Path(args.checkpoint).expanduser()
        if not (ckpt / "model").is_dir():
            newest = CheckpointStore(ckpt).latest()
            if newest is None:
                raise EvalInputError(f"--checkpoint {ckpt}: neither a checkpoint (no model/) nor a directory of "
                                     "checkpoints (no step-*-v*/)")
            ckpt = newest
        return ckpt / "model"
    if args.weights:
        return await _published_weights(args.weights, scratch)
    return Path(args.model_dir).expanduser()


async def _published_weights(config_path: str, scratch: Path) -> Path:
    """The latest version on the deployment's weights bucket, over its model directory's config and tokenizer."""
    from engine.config import ConfigError, load_config
    from engine.topics import Names
    from streams.nats import Nats, NatsError
    from streams.weights import IncompleteModelDir, fetch_latest_model

    try:
        cfg = load_config(config_path)
    except (ConfigError, OSError) as exc:
        raise EvalInputError(f"--weights {config_path}: {exc}") from None
    base = cfg.inference.model_dir
    if not base:
        raise EvalInputError(f"--weights {config_path}: inference.model_dir is not set (the published weights need "
                             "its config and tokenizer)")
    names = Names(cfg.namespace)
    try:
        nats = await Nats(cfg.nats).connect()
    except (NatsError, OSError) as exc:
        raise PolicyError(f"--weights: cannot reach NATS at {cfg.nats.url}: {exc}") from None
    try:
        try:
            latest = await fetch_latest_model(nats, names, Path(base).expanduser(), scratch / "fetched", scratch / "policy")
        except (NatsError, IncompleteModelDir) as exc:
            raise PolicyError(f"--weights: fetching the latest version: {exc}") from None
        if latest is None:
            raise PolicyError(f"--weights: namespace {cfg.namespace!r} has no published weight version")
        manifest, out = latest
        print(f"rollout eval: weight version {manifest.version} (step {manifest.step}) of {cfg.namespace!r}",
              file=sys.stderr)
        return out
    finally:
        await nats.close()


async def _serve_and_play(model_dir: Path, tasks: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    from actors.evaluate import run_episodes
    from modelserver.backends import inference_backend
    from modelserver.launch import LocalServerError
    from engine.config import InferenceConfig

    if not model_dir.is_dir():
        raise EvalInputError(f"model directory {model_dir}: no such directory")
    from modelserver.model_dir import ModelDirError, check_model_dir

    try:
        check_model_dir(model_dir)
    except ModelDirError as exc:
        raise EvalInputError(f"model directory {model_dir}: {exc}") from None
    launch = inference_backend("local").launch
    assert launch is not None
    tokenizer = _tokenizer(str(model_dir))
    with tempfile.TemporaryDirectory(prefix="rollout-eval-") as run_dir:
        try:
            async with launch(InferenceConfig(), model_dir, Path(run_dir)) as url:
                return await run_episodes(url, tasks, tokenizer=tokenizer, **kwargs)
        except LocalServerError as exc:
            raise PolicyError(str(exc)) from None


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/... for a directory without a tokenizer
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise EvalInputError(f"cannot load a tokenizer from {path}: {first}") from None


COLUMNS = ("domain", "tasks", "samples", "completion", "95% CI", "correctness", "pass@1 (95% CI)", "pass@K (95% CI)",
           "turns", "tokens")


def _columns(samples: int) -> list[str]:
    """The table's columns; pass@K only when K > 1 (with one sample it is pass@1)."""
    return [c.replace("K", str(samples)) for c in COLUMNS if not c.startswith("pass@K") or samples > 1]


def _with_interval(value: float, interval: tuple[float, float]) -> str:
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def table_rows(reports: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in reports.values():
        lo, hi = r.completion_ci95
        row = [r.domain, str(r.tasks), str(r.samples), f"{r.completion_rate:.3f}", f"[{lo:.3f}, {hi:.3f}]",
               f"{r.mean_correctness:.3f}", _with_interval(r.pass_at_1, r.pass_at_1_ci95)]
        row += [_with_interval(r.pass_at_k, r.pass_at_k_ci95)] if r.samples > 1 else []
        rows.append(row + [f"{r.mean_turns:.2f}", f"{r.mean_tokens:.1f}"])
    return rows


def format_table(reports: dict[str, Any]) -> str:
    """The report as an aligned plain-text table, one row per domain."""
    rows = [_columns(next(iter(reports.values())).samples)] + table_rows(reports)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_markdown(reports: dict[str, Any], policy: str) -> str:
    """The report as a Markdown table under a line naming the policy."""
    header = _columns(next(iter(reports.values())).samples)
    lines = [f"Evaluation of `{policy}`", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(reports)]
    return "\n".join(lines) + "\n"


def _eval(args: argparse.Namespace) -> int:
    import anyio

    try:
        if args.samples < 1:
            raise EvalInputError(f"--samples must be at least 1, got {args.samples}")
        if args.samples > 1 and args.temperature is not None and args.temperature <= 0:
            raise EvalInputError(f"--samples {args.samples} needs --temperature > 0")
        if args.tokenizer and not args.url:
            raise EvalInputError("--tokenizer goes with --url (a --model-dir brings its own)")
        if (args.map or args.tasks_domain or args.limit is not None) and not args.tasks:
            raise EvalInputError("--map, --tasks-domain and --limit go with --tasks FILE")
        if args.limit is not None and args.limit < 1:
            raise EvalInputError(f"--limit must be at least 1, got {args.limit}")
        if args.temperature is None:
            args.temperature = 1.0 if args.samples > 1 else 0.0
        tasks = load_tasks(args)
        reports, records = anyio.run(_run_or_policy_error, args, tasks)
    except EvalInputError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except PolicyError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    policy = args.url or args.model_dir or args.checkpoint or f"latest weights of {args.weights}"
    print(format_table(reports))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "policy": policy, "samples": args.samples, "temperature": args.temperature, "seed": args.seed, "sandbox_backend": args.sandbox_backend,
            "domains": {d: dataclasses.asdict(r) for d, r in reports.items()},
            "episodes": [dataclasses.asdict(r) for r in records]}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(reports, str(policy)))
    return 0
