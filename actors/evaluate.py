"""Held-out evaluation: generations on a domain's held-out tasks, judged by its verifier.

Greedy by default (one generation per task). With ``samples=k`` and a ``temperature`` each task is
answered k times by sampling (seeds fixed by the evaluation's seed, the task and the sample), and the
accuracy is the mean over all of them: the expected accuracy of the sampling policy, which is what RL
optimises, measured on prompts it never trained on.

Runs against any SGLang-protocol server (the local backend in the demo) and real sandboxes; it does
not go through Kafka, so it measures the policy, not the pipeline. Multi-turn domains are played
exactly as the inference actor plays them (same stop, the domain's tools declared in the prompt, the same
observation rendering: :func:`actors.inference.actor.observation_ids`, tool results in the ``tool`` role).

Two layers: :func:`run_episodes` plays any list of :class:`EvalTask` (a domain's held-out tasks or the
rows of a user's task file) and returns one :class:`EpisodeRecord` per generation (correctness, turns,
generated tokens); :func:`summarise` turns those into a :class:`EvalReport` per domain (completion
rate with a 95% Wilson interval, pass@1 and pass@k). ``rollout eval`` uses both; :func:`evaluate`
(the demo's and the load tests' entry point) is the held-out special case reduced to a :class:`DomainScore`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio

from domains import DOMAINS, score
from actors.inference.actor import format_observation, observation_ids, observation_text
from modelserver.client import SGLangClient
from modelserver.llm import has_chat_template, render_prompt
from engine.eval_stats import mean_interval, pass_at_k, wilson_interval
from sandboxes import SandboxPool


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
                tokenizer: Any = None, max_turns: int | None = None,
                usage: dict[str, int] | None = None) -> tuple[str, dict[str, Any]]:
    """One held-out episode. With a chat ``tokenizer`` the prompt is rendered with its chat template and turns
    end at the model's end-of-turn token, exactly as the inference actor plays them; else raw text, newline stops."""
    chat = tokenizer is not None and has_chat_template(tokenizer)
    budget = DOMAINS[domain].budget(spec, max_new_tokens)  # the task's own budget, else the domain's, else the default
    params: dict[str, Any] = {"max_new_tokens": budget, "temperature": temperature}
    if not chat:  # raw text: the domain's stop strings (a newline for domains that declare none)
        params["stop"] = list(DOMAINS[domain].stop or ("\n",))
    if temperature > 0 and sampling_seed is not None:
        params["sampling_seed"] = sampling_seed
    counts = usage if usage is not None else {}
    counts.setdefault("turns", 0)
    counts.setdefault("tokens", 0)

    async def generate(context: Any) -> Any:
        if chat:
            result = await client.generate(list(context), sampling_params=params, return_logprob=False)
        else:
            result = await client.generate(text=context, sampling_params=params, return_logprob=False)
        counts["turns"] += 1
        counts["tokens"] += result.completion_tokens or len(result.output_ids)
        return result

    tools = list(DOMAINS[domain].tools)
    context: Any = render_prompt(tokenizer, prompt, tools=tools or None) if chat else prompt
    turns = max_turns or DOMAINS[domain].turns(spec)
    if turns <= 1:
        result = await generate(context)
        return result.text, await DOMAINS[domain].verify(result.text, spec, pool)
    episode = DOMAINS[domain].new_episode(spec, pool)
    await episode.open()
    commands: list[str] = []
    try:
        for _ in range(turns):
            result = await generate(context)
            command = result.text.strip()
            commands.append(command)
            if "sampling_seed" in params:  # the next turn draws differently
                params["sampling_seed"] += 1 << 40
            if not command or command in ("exit", "done"):
                break
            observation = await episode.step(command)
            if chat:  # token in, token out: the context grows by the sampled ids and the observation's ids
                last = result.output_ids[-1] if result.output_ids else None
                context = list(context) + list(result.output_ids) + observation_ids(tokenizer, observation, last)
            else:
                context += result.text + "\n" + format_observation(observation_text(observation))
    finally:
        facts = await episode.finish()
    return "\n".join(commands), facts


@dataclasses.dataclass(frozen=True, slots=True)
class EvalTask:
    """One task to evaluate: a domain's held-out task or a row of a user's task file."""

    id: str
    domain: str
    prompt: str
    spec: dict[str, Any]
    max_turns: int | None = None
    """None: the domain's own turn count for ``spec``."""


@dataclasses.dataclass(frozen=True, slots=True)
class EpisodeRecord:
    """One generation (episode) of one task: what :func:`summarise` aggregates and ``--json`` lists."""

    task_id: str
    domain: str
    sample: int
    correctness: float
    """The verifier's correctness in [0, 1] (answer right, fraction of tests or checks passed)."""
    turns: int
    tokens: int
    """Tokens generated over all turns."""

    @property
    def solved(self) -> bool:
        return self.correctness >= 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class EvalReport:
    """One domain's evaluation: ``tasks`` tasks x ``samples`` generations."""

    domain: str
    tasks: int
    samples: int
    episodes: int
    solved: int
    """Episodes fully solved (correctness 1)."""
    completion_rate: float
    completion_ci95: tuple[float, float]
    """Wilson 95% interval of ``completion_rate`` over the episodes (generations taken as independent)."""
    mean_correctness: float
    pass_at_1: float
    pass_at_k: float
    """Unbiased pass@k with k = ``samples``, averaged over tasks (= pass@1 when samples is 1)."""
    pass_at_1_ci95: tuple[float, float]
    pass_at_k_ci95: tuple[float, float]
    """95% intervals of pass@1 and pass@k over the tasks (:func:`engine.eval_stats.mean_interval`)."""
    mean_turns: float
    mean_tokens: float


def summarise(records: list[EpisodeRecord], samples: int) -> dict[str, EvalReport]:
    """Per-domain reports from the episode records of :func:`run_episodes` (``samples`` per task)."""
    by_domain: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        by_domain.setdefault(r.domain, []).append(r)
    out: dict[str, EvalReport] = {}
    for domain, recs in by_domain.items():
        per_task: dict[str, list[EpisodeRecord]] = {}
        for r in recs:
            per_task.setdefault(r.task_id, []).append(r)
        solved = sum(r.solved for r in recs)
        n = len(recs)
        p1 = [pass_at_k(len(rs), sum(r.solved for r in rs), 1) for rs in per_task.values()]
        pk = [pass_at_k(len(rs), sum(r.solved for r in rs), min(samples, len(rs))) for rs in per_task.values()]
        out[domain] = EvalReport(
            domain=domain, tasks=len(per_task), samples=samples, episodes=n, solved=solved,
            completion_rate=solved / n, completion_ci95=wilson_interval(solved, n),
            mean_correctness=sum(r.correctness for r in recs) / n,
            pass_at_1=sum(p1) / len(p1), pass_at_k=sum(pk) / len(pk),
            pass_at_1_ci95=mean_interval(p1), pass_at_k_ci95=mean_interval(pk),
            mean_turns=sum(r.turns for r in recs) / n, mean_tokens=sum(r.tokens for r in recs) / n)
    return out


def file_tasks(path: str, *, default_domain: str | None = None,
               mapping: dict[str, str] | None = None) -> list[EvalTask]:
    """The rows of a user's task file as evaluation tasks (read as the scheduler reads it; TaskFileError if bad)."""
    from engine.tasks import TaskFile

    tf = TaskFile(path, known_domains=DOMAINS, default_domain=default_domain, mapping=mapping)
    return [EvalTask(t.id, t.domain, t.prompt, t.spec, t.max_turns) for t in tf.tasks]


def heldout_tasks(domains: dict[str, int], *, seed: int = 0, difficulty: float = 0.0) -> list[EvalTask]:
    """Up to ``domains[name]`` held-out tasks of each built-in domain; ValueError naming an unknown domain."""
    for name in domains:  # ``in``/lookup resolve families (rg:NAME); the error says why (unknown, or unavailable here)
        try:
            DOMAINS[name]
        except KeyError as exc:
            raise ValueError(str(exc)) from None
    out: list[EvalTask] = []
    for domain, n in domains.items():
        for i, (prompt, spec) in enumerate(DOMAINS[domain].heldout(n, seed=seed, difficulty=difficulty)):
            out.append(EvalTask(f"{domain}:heldout:{i}", domain, prompt, spec))
    return out


async def run_episodes(url: str, tasks: list[EvalTask], *, seed: int = 0, max_new_tokens: int = 32,
                       concurrency: int = 16, samples: int = 1, temperature: float = 0.0, tokenizer: Any = None,
                       sandbox_backend: str = "bwrap", api_key: str | None = None,
                       request_timeout_s: float = 120.0) -> list[EpisodeRecord]:
    """Play every task ``samples`` times against ``url``, verified in ``sandbox_backend`` sandboxes.

    Records come back in task order, then sample order. Sampling seeds are fixed by ``seed``, the task's
    index and the sample, so the same call draws the same generations.
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"samples={samples} needs a temperature > 0 (greedy generations would all be the same)")
    records: list[EpisodeRecord | None] = [None] * (len(tasks) * samples)
    limiter = anyio.Semaphore(concurrency)
    async with (SGLangClient([url], timeout=request_timeout_s, api_key=api_key) as client,
                SandboxPool(sandbox_backend, size=min(4, concurrency), max_size=concurrency) as pool):

        async def one(i: int, j: int, task: EvalTask, k: int) -> None:
            usage: dict[str, int] = {}
            async with limiter:
                text, facts = await _play(client, task.prompt, task.spec, task.domain, pool, max_new_tokens,
                                          temperature, sampling_seed=seed * 1_000_000_000 + k * samples + j,
                                          tokenizer=tokenizer, max_turns=task.max_turns, usage=usage)
            records[i * samples + j] = EpisodeRecord(task.id, task.domain, j, score(task.domain, facts, text).correctness,
                                                     usage["turns"], usage["tokens"])

        within: dict[str, int] = {}  # the task's index within its domain seeds its samples
        async with anyio.create_task_group() as tg:
            for i, task in enumerate(tasks):
                k = within[task.domain] = within.get(task.domain, -1) + 1
                for j in range(samples):
                    tg.start_soon(one, i, j, task, k)
    return [r for r in records if r is not None]


async def evaluate(url: str, domains: dict[str, int], *, seed: int = 0, difficulty: float = 0.0,
                   max_new_tokens: int = 32, concurrency: int = 16, samples: int = 1,
                   temperature: float = 0.0, tokenizer: Any = None) -> dict[str, DomainScore]:
    """Accuracy per domain on (up to) ``domains[name]`` held-out tasks each, ``samples`` generations per task.

    ``tokenizer``: the served model's; with a chat template, prompts are rendered with it (see ``_play``).
    """
    records = await run_episodes(url, heldout_tasks(domains, seed=seed, difficulty=difficulty), seed=seed,
                                 max_new_tokens=max_new_tokens, concurrency=concurrency, samples=samples,
                                 temperature=temperature, tokenizer=tokenizer)
    reports = summarise(records, samples)
    return {d: DomainScore(d, reports[d].tasks, reports[d].mean_correctness, reports[d].completion_rate, samples)
            if d in reports else DomainScore(d, 0, 0.0, 0.0, samples) for d in domains}
