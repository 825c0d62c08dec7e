"""Held-out evaluation: generations on a domain's held-out tasks, judged by its verifier.

Greedy by default (one generation per task). With ``samples=k`` and a ``temperature`` each task is
answered k times by sampling (seeds fixed by the evaluation's seed, the task and the sample), and the
accuracy is the mean over all of them: the expected accuracy of the sampling policy, which is what RL
optimises, measured on prompts it never trained on.

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
from actors.llm import has_chat_template, render_observation, render_prompt
from sandboxes import SandboxPool
from sandboxes.verifiers import VERIFIERS, TerminalEpisode


@dataclasses.dataclass(frozen=True, slots=True)
class DomainScore:
    domain: str
    tasks: int
    accuracy: float
    """Mean correctness (answer right / fraction of tests or checks passed)."""
    solved: float
    """Fraction of tasks fully solved (of all generations, when sampled)."""
    samples: int = 1
    """Generations per task."""


async def _play(client: SGLangClient, prompt: str, spec: dict[str, Any], domain: str, pool: SandboxPool,
                max_new_tokens: int, temperature: float = 0.0, sampling_seed: int | None = None,
                tokenizer: Any = None) -> tuple[str, dict[str, Any]]:
    """One held-out episode. With a chat ``tokenizer`` the prompt is rendered with its chat template and turns
    end at the model's end-of-turn token, exactly as the inference actor plays them; else raw text, newline stops."""
    chat = tokenizer is not None and has_chat_template(tokenizer)
    budget = DOMAINS[domain].max_new_tokens or max_new_tokens
    params: dict[str, Any] = {"max_new_tokens": budget, "temperature": temperature}
    if not chat:
        params["stop"] = ["\n"]
    if temperature > 0 and sampling_seed is not None:
        params["sampling_seed"] = sampling_seed
    verifier = DOMAINS[domain].verifier

    async def generate(context: Any) -> Any:
        if chat:
            return await client.generate(list(context), sampling_params=params, return_logprob=False)
        return await client.generate(text=context, sampling_params=params, return_logprob=False)

    context: Any = render_prompt(tokenizer, prompt) if chat else prompt
    if DOMAINS[domain].turns(spec) <= 1:
        result = await generate(context)
        return result.text, await VERIFIERS[verifier](result.text, spec, pool)
    episode = TerminalEpisode(spec, pool)
    await episode.open()
    commands: list[str] = []
    try:
        for _ in range(DOMAINS[domain].turns(spec)):
            result = await generate(context)
            command = result.text.strip()
            commands.append(command)
            if "sampling_seed" in params:  # the next turn draws differently
                params["sampling_seed"] += 1 << 40
            if not command or command in ("exit", "done"):
                break
            observation = await episode.step(command)
            if chat:
                ended = bool(result.output_ids) and result.output_ids[-1] == tokenizer.eos_token_id
                context = list(context) + list(result.output_ids) + render_observation(
                    tokenizer, format_observation(observation), ended_turn=ended)
            else:
                context += result.text + "\n" + format_observation(observation)
    finally:
        facts = await episode.finish()
    return "\n".join(commands), facts


async def evaluate(url: str, domains: dict[str, int], *, seed: int = 0, difficulty: float = 0.0,
                   max_new_tokens: int = 32, concurrency: int = 16, samples: int = 1,
                   temperature: float = 0.0, tokenizer: Any = None) -> dict[str, DomainScore]:
    """Accuracy per domain on (up to) ``domains[name]`` held-out tasks each, ``samples`` generations per task.

    ``tokenizer``: the served model's; with a chat template, prompts are rendered with it (see ``_play``).
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"samples={samples} needs a temperature > 0 (greedy generations would all be the same)")
    out: dict[str, DomainScore] = {}
    limiter = anyio.Semaphore(concurrency)
    async with SGLangClient([url], timeout=120) as client, SandboxPool("bwrap", size=4, max_size=concurrency) as pool:
        for domain, n in domains.items():
            tasks = DOMAINS[domain].heldout(n, seed=seed, difficulty=difficulty)
            correct: list[float] = [0.0] * (len(tasks) * samples)

            async def one(i: int, j: int, prompt: str, spec: dict[str, Any]) -> None:
                async with limiter:
                    text, facts = await _play(client, prompt, spec, domain, pool, max_new_tokens, temperature,
                                              sampling_seed=seed * 1_000_000_000 + i * samples + j,
                                              tokenizer=tokenizer)
                correct[i * samples + j] = score(domain, facts, text).correctness

            async with anyio.create_task_group() as tg:
                for i, (prompt, spec) in enumerate(tasks):
                    for j in range(samples):
                        tg.start_soon(one, i, j, prompt, spec)
            out[domain] = DomainScore(domain, len(tasks), sum(correct) / max(1, len(correct)),
                                      sum(c >= 1.0 for c in correct) / max(1, len(correct)), samples)
    return out
