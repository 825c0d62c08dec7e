"""The multi-domain benchmark's ONE evaluator: held-out accuracy per domain of several model directories.

``python -m loadtests._multidomain_eval --domains a,b --tasks N --samples K --temperature T --json OUT
NAME=DIR ...``: each directory is served in turn by the local inference server and answers the same
held-out tasks (``actors.evaluate.heldout_tasks``, seed ``--seed``) with the same sampling seeds
(``loadtests.domains.measure``: the episodes, sandboxes and verifiers of training), so two models differ only
by their weights. Writes ``{NAME: {domain: {"episodes", "solved", "accuracy", "ci95", "mean_correctness",
"mean_tokens"}} | "error: ..."}`` and prints one JSON line per model as it finishes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def score_model(model_dir: Path, names: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    import anyio

    from loadtests.domains import measure

    reports = anyio.run(measure, model_dir, names, args)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        r = reports.get(name)
        if r is None:
            out[name] = {"episodes": 0, "solved": 0, "accuracy": None, "ci95": None, "mean_correctness": None,
                         "mean_tokens": None}
            continue
        out[name] = {"episodes": r.episodes, "solved": r.solved, "accuracy": round(r.completion_rate, 4),
                     "ci95": [round(x, 4) for x in r.completion_ci95],
                     "mean_correctness": round(r.mean_correctness, 4), "mean_tokens": round(r.mean_tokens, 1)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--domains", required=True)
    p.add_argument("--tasks", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--temperature", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--json", required=True)
    p.add_argument("models", nargs="+", help="NAME=DIR")
    args = p.parse_args(argv)
    names = [n for n in args.domains.split(",") if n]
    out: dict[str, Any] = {}
    for name, path in (m.split("=", 1) for m in args.models):
        try:
            out[name] = score_model(Path(path), names, args)
        except Exception as exc:  # one unreadable directory must not cost the others their score
            out[name] = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
        print(json.dumps({name: out[name]}), flush=True)
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
