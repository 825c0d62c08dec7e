"""TRL's ``GRPOTrainer`` on the multi-domain benchmark's mixed dataset, rewarded by the engine's own verifiers.

``python -m loadtests._trl_multidomain MODEL_DIR SECONDS SAVE_DIR --domains a,b,c [--seed S]
[--max-new-tokens N]``: the training tasks of every named domain (``Domain.generate`` at difficulty 0,
the split the engine trains on; never a held-out prompt), interleaved in equal numbers (the engine's
``scheduler.domains = {name = 1.0, ...}``), as conversational prompts. The reward function plays the part
of the engine's reward actor: each completion is checked by its domain's verifier
(``DOMAINS[name].verify``; code runs in a ``SandboxPool("bwrap")`` opened in this process for the whole
run) and scored by ``domains.reward_fn`` (the domain's ``reward``). Single-turn domains only: a
multi-turn episode has no place in ``GRPOTrainer``. Geometry and budget: :func:`loadtests._trl_runner.train_grpo`;
``max_completion_length`` is the largest budget of the domains (TRL has one for all). Exits 3 without ``trl``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtests._trl_runner import NOT_INSTALLED, completion_text, train_grpo, trl_available

TASKS_PER_DOMAIN = 2000
DEFAULT_NEW_TOKENS = 32


def training_rows(names: list[str], *, per_domain: int, seed: int) -> list[dict[str, Any]]:
    """``per_domain`` training tasks of each domain, interleaved: ``{"prompt", "domain", "spec"}`` (spec as JSON)."""
    from domains import DOMAINS

    columns = []
    for i, name in enumerate(names):
        rng = random.Random(seed * 1000 + i)
        rows = []
        for _ in range(per_domain):
            prompt, spec = DOMAINS[name].generate(rng, 0.0)
            rows.append({"prompt": [{"role": "user", "content": prompt}], "domain": name,
                         "spec": json.dumps(spec, sort_keys=True)})
        columns.append(rows)
    return [row for group in zip(*columns) for row in group]


def completion_budget(names: list[str], default: int) -> int:
    from domains import DOMAINS

    return max(DOMAINS[n].budget({}, default) or default for n in names)


@contextlib.contextmanager
def engine_rewards(names: list[str]) -> Iterator[Any]:
    """A TRL reward function ``(completions, domain, spec, **_) -> rewards`` that verifies with the engine's
    verifiers in a blocking portal (one event loop and one sandbox pool for the whole run)."""
    import anyio
    from anyio.from_thread import start_blocking_portal

    from domains import DOMAINS, reward_fn
    from sandboxes import SandboxPool

    sandboxed = any(DOMAINS[n].needs_sandbox for n in names)
    with start_blocking_portal() as portal:
        with contextlib.ExitStack() as stack:
            pool = (stack.enter_context(portal.wrap_async_context_manager(SandboxPool("bwrap", size=2, max_size=8)))
                    if sandboxed else None)

            async def verify_all(items: list[tuple[str, str, dict[str, Any]]]) -> list[float]:
                out = [0.0] * len(items)

                async def one(i: int, text: str, domain: str, spec: dict[str, Any]) -> None:
                    facts = await DOMAINS[domain].verify(text, spec, pool)
                    out[i] = float(reward_fn(domain, facts, text))

                async with anyio.create_task_group() as tg:
                    for i, (text, domain, spec) in enumerate(items):
                        tg.start_soon(one, i, text, domain, spec)
                return out

            def reward(completions: list, domain: list[str], spec: list[str], **_: object) -> list[float | None]:
                items = [(completion_text(c), d, json.loads(s)) for c, d, s in zip(completions, domain, spec)]
                return list(portal.call(verify_all, items))

            yield reward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("seconds", type=float)
    p.add_argument("save_dir", type=Path)
    p.add_argument("--domains", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS)
    p.add_argument("--tasks-per-domain", type=int, default=TASKS_PER_DOMAIN)
    args = p.parse_args(argv)
    why = trl_available()
    if why is not None:
        print(f"trl not installed: {why}", file=sys.stderr)
        return NOT_INSTALLED
    names = [n for n in args.domains.split(",") if n]
    rows = training_rows(names, per_domain=args.tasks_per_domain, seed=args.seed)
    with engine_rewards(names) as reward:
        return train_grpo(args.model_dir, args.seconds, args.save_dir, rows, reward,
                          max_completion_length=completion_budget(names, args.max_new_tokens), seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
