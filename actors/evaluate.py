"""Held-out evaluation: greedy generations on a domain's held-out tasks, judged by its verifier.

Runs against any SGLang-protocol server (the local backend in the demo) and real sandboxes; it does
not go through Kafka, so it measures the policy, not the pipeline. Multi-turn domains are played
exactly as the inference actor plays them (same stop, same observation format).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio

from actors.domains import DOMAINS, score
from actors.inference.actor import format_observation
from actors.inference.sglang_client import SGLangClient
from sandboxes import SandboxPool
from sandboxes.verifiers import VERIFIERS, TerminalEpisode


@dataclasses.dataclass(frozen=True, slots=True)
class DomainScore:
    domain: str
    tasks: int
    accuracy: float
    """Mean correctness (answer right / fraction of tests or checks passed)."""
    solved: float
    """Fraction of tasks fully solved."""


async def _play(client: SGLangClient, prompt: str, spec: dict[str, Any], domain: str, pool: SandboxPool,
                max_new_tokens: int) -> tuple[str, dict[str, Any]]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop": ["\n"]}
    verifier = DOMAINS[domain].verifier
    if DOMAINS[domain].turns(spec) <= 1:
        result = await client.generate(text=prompt, sampling_params=params, return_logprob=False)
        return result.text, await VERIFIERS[verifier](result.text, spec, pool)
    episode = TerminalEpisode(spec, pool)
    await episode.open()
    context, commands = prompt, []
    try:
        for _ in range(DOMAINS[domain].turns(spec)):
            result = await client.generate(text=context, sampling_params=params, return_logprob=False)
            command = result.text.strip()
            commands.append(command)
            if not command or command in ("exit", "done"):
                break
            observation = await episode.step(command)
            context += result.text + "\n" + format_observation(observation)
    finally:
        facts = await episode.finish()
    return "\n".join(commands), facts


async def evaluate(url: str, domains: dict[str, int], *, seed: int = 0, difficulty: float = 0.0,
                   max_new_tokens: int = 32, concurrency: int = 16) -> dict[str, DomainScore]:
    """Accuracy per domain on ``domains[name]`` held-out tasks each."""
    out: dict[str, DomainScore] = {}
    limiter = anyio.Semaphore(concurrency)
    async with SGLangClient([url], timeout=120) as client, SandboxPool("bwrap", size=4, max_size=concurrency) as pool:
        for domain, n in domains.items():
            tasks = DOMAINS[domain].heldout(n, seed=seed, difficulty=difficulty)
            correct: list[float] = [0.0] * len(tasks)

            async def one(i: int, prompt: str, spec: dict[str, Any]) -> None:
                async with limiter:
                    text, facts = await _play(client, prompt, spec, domain, pool, max_new_tokens)
                correct[i] = score(domain, facts, text).correctness

            async with anyio.create_task_group() as tg:
                for i, (prompt, spec) in enumerate(tasks):
                    tg.start_soon(one, i, prompt, spec)
            out[domain] = DomainScore(domain, len(tasks), sum(correct) / max(1, len(tasks)),
                                      sum(c >= 1.0 for c in correct) / max(1, len(tasks)))
    return out
