"""The domain interface: what the engine knows about one kind of task, and the one registry of domains.

A :class:`Domain` declares everything about a kind of task, and no engine code names a particular one:

- **tasks**: ``make(rng, difficulty) -> GeneratedTask(prompt, spec, ideal)``, deterministic given the
  ``random.Random`` state (a seeded generator, or a reader that picks rows of a file); ``difficulty`` in
  [0, 1] is what the scheduler's curriculum drives (a domain with levels maps it onto them);
  ``length_to_difficulty`` (optional) lets the context-length curriculum steer it by prompt length;
- **prompt**: the task's ``prompt`` (a user turn, rendered with the model's chat template) and the domain's
  ``tools`` (JSON schemas, declared through the template's ``tools=``);
- **episode kind** (:data:`EPISODE_KINDS`): ``single`` (one reply, verified as text), ``shell`` (turns of
  shell commands in one sandbox, observations handed back as user turns) or ``tools`` (turns of tool calls
  in one sandbox, results handed back in the ``tool`` role); a multi-turn domain builds its episode with
  ``episode_factory(spec, pool_or_sandbox)`` and is judged from that episode's facts;
- **verifier**: a key of ``sandboxes.verifiers.VERIFIERS`` (``answer``, ``code``, ``terminal``) or the domain's
  own ``async verify(completion_text, spec, pool_or_sandbox) -> facts``; ``needs_sandbox`` says whether it
  executes model output in a sandbox (or only compares text in process);
- **reward**: ``reward(facts, text)`` and ``format_score(text)`` in [0, 1];
- **budget**: ``max_new_tokens`` per turn (a task's ``spec["max_new_tokens"]`` overrides it), ``max_turns``;
- **held-out split**: ``heldout_split(task)``; by default a stable hash of the prompt (below);
- **listing**: ``source`` (where tasks come from), ``description``, ``trainable`` (False: an evaluation set,
  never trained on), ``tags``.

Held-out split: a prompt belongs to the held-out split iff a stable hash of it falls in the held-out
buckets (``HELDOUT_BUCKETS`` of ``HASH_BUCKETS``); training tasks are drawn by rejection from the other
buckets. The two splits therefore never share a prompt, whatever the seeds. Held-out sets are drawn from
seed streams disjoint from any training stream (see :func:`split_rng`).

Registry: :data:`DOMAINS` (an :class:`engine.registry.Registry`) is the one table of domains. The built-in
domains' modules register on the first lookup; plugins arrive through the ``rollout_engine.domains``
entry-point group or a ``module:attr`` name in the config (``[domains] plugins``); a family of domains
(``rg:NAME``, reasoning-gym's datasets) resolves lazily. An entry point or ``module:attr`` may name a
:class:`Domain`, a list of them, or a :class:`DomainFamily` with its ``prefix``.

Rewards (:func:`reward_fn`): ``correctness + format_weight * format - length_penalty * generated_tokens``.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from engine.config import RewardConfig
from engine.registry import Family, Registry
from engine.schemas import Completion
from sandboxes.verifiers import VERIFIERS, Verifier

Spec = dict[str, Any]
Facts = dict[str, Any]
TaskFn = Callable[[random.Random, float], "GeneratedTask"]
RewardFn = Callable[[Facts, str], float]
FormatFn = Callable[[str], float]

HASH_BUCKETS = 10
HELDOUT_BUCKETS = 3
"""Held-out share of every domain's prompt space, in buckets of ``HASH_BUCKETS`` (30%): enough distinct
held-out prompts at the easiest level (arith 34, code 26, terminal 51) for an accuracy to mean something."""
HELDOUT_DRAWS_PER_TASK = 50
MAX_REJECTIONS = 1000
STOP = "\n"
EPISODE_KINDS = ("single", "shell", "tools")
"""``single``: one reply verified as text; ``shell``: shell commands, observations as user turns; ``tools``:
tool calls, results in the ``tool`` role. The last two hold one sandbox for the episode."""
SANDBOX_VERIFIERS = frozenset({"code", "terminal"})
"""Built-in verifiers that run model output in a sandbox (``answer`` compares text in process)."""
ENTRY_POINT_GROUP = "rollout_engine.domains"


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratedTask:
    """One task with its ideal completion (what a demonstration shows)."""

    prompt: str
    spec: Spec
    ideal: str


def is_heldout(prompt: str) -> bool:
    """Whether ``prompt`` belongs to the held-out split (stable across processes and Python versions)."""
    return zlib.crc32(prompt.encode()) % HASH_BUCKETS < HELDOUT_BUCKETS


def heldout_by_prompt(task: GeneratedTask) -> bool:
    """The default split: :func:`is_heldout` of the task's prompt."""
    return is_heldout(task.prompt)


def split_rng(seed: int, split: str) -> random.Random:
    """The random stream of one split; ``train`` and ``heldout`` streams of any seeds never coincide."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return random.Random(f"{split}:{seed}")


class Episode(Protocol):
    """A multi-turn episode in one sandbox, as the episode actor and the evaluation drive it."""

    max_turns: int

    async def open(self) -> None: ...

    @property
    def done(self) -> bool: ...

    async def step(self, command: str) -> str | list[dict[str, Any]]:
        """Run one model reply; the observation: a ``shell`` episode's output text, or a ``tools`` episode's
        chat messages (``{"role": "tool", "name", "content"}`` per call, a ``user`` hint when there was none),
        handed back to the model whole as the template's turns."""
        ...

    async def finish(self) -> Facts:
        """Judge the final state, release the sandbox, return the facts the reward reads."""
        ...

    async def abandon(self) -> None:
        """Release the sandbox without judging (idempotent)."""
        ...


EpisodeFactory = Callable[[Spec, Any], Episode]


def _shell_episode(spec: Spec, pool_or_sandbox: Any) -> Episode:
    from sandboxes.verifiers import TerminalEpisode
    return TerminalEpisode(spec, pool_or_sandbox)


@dataclasses.dataclass(frozen=True)
class Domain:
    """A kind of task: tasks, prompt and tools, episode kind, verifier, reward, budget, split (module docstring)."""

    name: str
    verifier: str | Verifier
    """What judges this domain's completions: a key of ``sandboxes.verifiers.VERIFIERS`` (``answer``,
    ``code``, ``terminal``) or the domain's own ``async verify(completion_text, spec, pool) -> facts``
    (``pool`` is the sandbox role's ``SandboxPool``; facts are what its ``reward`` reads)."""
    make: TaskFn
    reward: RewardFn
    format_score: FormatFn
    max_turns: int = 1
    stop: tuple[str, ...] = (STOP,)
    max_new_tokens: int | None = None
    """Generation budget of this domain's tasks (per turn); None: the deployment's ``inference.max_new_tokens``.
    A task's ``spec["max_new_tokens"]`` overrides it (:meth:`budget`)."""
    episode: str = ""
    """One of :data:`EPISODE_KINDS`; '' derives it: ``shell`` when ``max_turns > 1``, else ``single``."""
    episode_factory: EpisodeFactory | None = None
    """Builds a multi-turn episode (``tools`` domains must give one; ``shell`` defaults to the terminal episode)."""
    tools: tuple[dict[str, Any], ...] = ()
    """Tools declared to the model (OpenAI / Hugging Face function schemas), rendered with ``tools=``."""
    sandbox: bool | None = None
    """Whether verifying runs model output in a sandbox; None derives it from the verifier and episode kind."""
    source: str = "generator"
    """Where tasks come from, for listings (``generator``, ``reasoning-gym 0.1.25``, a file, ...)."""
    description: str = ""
    trainable: bool = True
    """False: an evaluation set (a benchmark), never trained on; the scheduler refuses it."""
    heldout_split: Callable[[GeneratedTask], bool] = heldout_by_prompt
    """Whether a task is in the held-out split (default: the stable hash of its prompt; a domain whose prompts
    repeat splits by what differs, e.g. an environment's seed)."""
    length_to_difficulty: Callable[[int], float] | None = None
    """A prompt length in tokens -> the difficulty that makes prompts that long (the length curriculum)."""
    tags: frozenset[str] = frozenset()
    """Free labels (``char``: the character-level fixture's domains; ``chat``: for instruct models; ...)."""

    def __post_init__(self) -> None:
        if self.episode and self.episode not in EPISODE_KINDS:
            raise ValueError(f"domain {self.name!r}: episode {self.episode!r} is not one of {EPISODE_KINDS}")
        if self.episode_kind == "tools" and self.episode_factory is None:
            raise ValueError(f"domain {self.name!r}: a 'tools' episode needs an episode_factory")
        if self.max_turns < 1:
            raise ValueError(f"domain {self.name!r}: max_turns must be at least 1, got {self.max_turns}")

    @property
    def episode_kind(self) -> str:
        return self.episode or ("shell" if self.max_turns > 1 else "single")

    @property
    def multi_turn(self) -> bool:
        """Whether the domain's tasks are played as episodes (judged from the episode's own facts)."""
        return self.episode_kind != "single"

    @property
    def needs_sandbox(self) -> bool:
        if self.sandbox is not None:
            return self.sandbox
        return self.multi_turn or (isinstance(self.verifier, str) and self.verifier in SANDBOX_VERIFIERS)

    def new_episode(self, spec: Spec, pool_or_sandbox: Any) -> Episode:
        """The episode object that plays one of this domain's multi-turn tasks."""
        factory = self.episode_factory or _shell_episode
        return factory(spec, pool_or_sandbox)

    def budget(self, spec: Spec, default: int | None = None) -> int | None:
        """Tokens per turn for one task: the task's ``max_new_tokens``, else the domain's, else ``default``."""
        value = spec.get("max_new_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return self.max_new_tokens or default

    def _draw(self, rng: random.Random, difficulty: float, split: str) -> GeneratedTask:
        want_heldout = split == "heldout"
        for _ in range(MAX_REJECTIONS):
            task = self.make(rng, min(1.0, max(0.0, difficulty)))
            if self.heldout_split(task) == want_heldout:
                return task
        raise RuntimeError(f"domain {self.name!r}: no {split} task after {MAX_REJECTIONS} draws "
                           f"at difficulty {difficulty}")

    def generate(self, rng: random.Random, difficulty: float = 0.0) -> tuple[str, Spec]:
        """A training task ``(prompt, spec)``; never a held-out prompt."""
        task = self._draw(rng, difficulty, "train")
        return task.prompt, task.spec

    def demonstrate(self, rng: random.Random, difficulty: float = 0.0) -> tuple[str, str]:
        """A training prompt with its ideal completion, for supervised warm start."""
        task = self._draw(rng, difficulty, "train")
        return task.prompt, task.ideal

    def heldout(self, n: int, *, seed: int = 0, difficulty: float = 0.0) -> list[tuple[str, Spec]]:
        """Up to ``n`` held-out tasks with distinct prompts (deterministic for a seed).

        Fewer when the domain's held-out space at this difficulty is smaller: drawing stops after
        ``HELDOUT_DRAWS_PER_TASK * n`` draws. A repeated prompt would only weigh that prompt more, so an
        accuracy over these is one over distinct tasks.
        """
        return [(task.prompt, task.spec) for task in self.heldout_examples(n, seed=seed, difficulty=difficulty)]

    def heldout_examples(self, n: int, *, seed: int = 0, difficulty: float = 0.0) -> list[GeneratedTask]:
        """The tasks of :meth:`heldout` with their ideal completions (constant-answer baselines read these)."""
        rng = split_rng(seed, "heldout")
        out: dict[str, GeneratedTask] = {}
        for _ in range(HELDOUT_DRAWS_PER_TASK * n):
            if len(out) >= n:
                break
            task = self._draw(rng, difficulty, "heldout")
            out.setdefault(task.prompt, task)
        return list(out.values())

    def turns(self, spec: Spec) -> int:
        """Turn budget of one task."""
        return int(spec.get("max_turns", self.max_turns))

    @property
    def verifier_name(self) -> str:
        """The verifier an outcome names: the built-in verifier's key, or the domain's name for its own."""
        return self.verifier if isinstance(self.verifier, str) else self.name

    @property
    def verify(self) -> Verifier:
        """The verifier function (raises ``KeyError`` for an unknown built-in name)."""
        if isinstance(self.verifier, str):
            return VERIFIERS[self.verifier]
        return self.verifier


class DomainFamily(Family[Domain], Protocol):
    """A lazily resolved family of domains under one ``prefix`` (``rg`` -> ``rg:chain_sum``, ...)."""

    prefix: str


# -- the rewards of the built-in verifiers ------------------------------------------------------------

def answer_reward(facts: Facts, text: str) -> float:
    """1 when the verifier found the right answer."""
    return 1.0 if facts.get("correct") else 0.0


def code_reward(facts: Facts, text: str) -> float:
    """Fraction of tests passed."""
    total = int(facts.get("total", 0) or 0)
    return float(facts.get("passed", 0)) / total if total > 0 else 0.0


def terminal_reward(facts: Facts, text: str) -> float:
    """Fraction of final-state checks passed."""
    total = int(facts.get("checks_total", 0) or 0)
    return float(facts.get("checks_passed", 0)) / total if total > 0 else 0.0


VERIFIER_REWARDS: dict[str, RewardFn] = {"answer": answer_reward, "code": code_reward, "terminal": terminal_reward}
"""The reward of a task whose domain is not registered (a JSONL task, ``spec["verifier"]``), by verifier name."""


# -- the registry --------------------------------------------------------------------------------------

def _check(name: str, domain: Domain) -> None:
    if not isinstance(domain, Domain):
        raise TypeError(f"domain {name!r}: expected a Domain, got {type(domain).__name__}")
    if domain.name != name:
        raise ValueError(f"domain registered as {name!r} is named {domain.name!r}")
    if isinstance(domain.verifier, str) and domain.verifier not in VERIFIERS:
        raise ValueError(f"domain {domain.name!r}: verifier {domain.verifier!r} is not one of {sorted(VERIFIERS)} "
                         "(or pass the domain's own async verify function)")
    if not isinstance(domain.verifier, str) and not callable(domain.verifier):
        raise TypeError(f"domain {domain.name!r}: verifier must be a name or an async function, "
                        f"got {type(domain.verifier).__name__}")


def _adopt(registry: Registry[Domain], obj: object, origin: str) -> None:
    """What an entry point or ``module:attr`` may name: a Domain, a family (with ``prefix``), or a list of either;
    a callable taking no arguments is called first (a factory)."""
    if callable(obj) and not isinstance(obj, Domain) and not hasattr(obj, "resolve"):
        obj = obj()
    items: Iterable[object] = obj if isinstance(obj, (list, tuple)) else [obj]
    for item in items:
        if isinstance(item, Domain):
            registry.register(item.name, item, origin=origin, replace=registry.origin(item.name) == origin)
        elif hasattr(item, "resolve") and hasattr(item, "names") and isinstance(getattr(item, "prefix", None), str):
            registry.add_family(str(getattr(item, "prefix")), item, origin=origin, replace=True)  # type: ignore[arg-type]
        else:
            raise TypeError(f"expected a Domain, a domain family or a list of them, got {type(item).__name__}")


DOMAINS: Registry[Domain] = Registry(
    "domain", entry_point_group=ENTRY_POINT_GROUP, adopt=_adopt, check=_check,
    builtin_modules=("domains.builtin", "domains.repo", "domains.longdoc",
                     "domains.benchmarks", "domains.reasoning_gym"
))
"""Every domain by name: what the scheduler, the verify and reward actors and the evaluation read."""


def register_domain(domain: Domain, *, replace: bool = False) -> Domain:
    """Add ``domain`` to ``DOMAINS``: from then on it is generated, verified, rewarded and evaluated."""
    return DOMAINS.register(domain.name, domain, replace=replace, origin=domain.make.__module__)


def unregister_domain(name: str) -> Domain | None:
    """Remove a domain (tests that register their own); returns it, or None when it was not registered."""
    return DOMAINS.unregister(name)


def load_domain_plugins(specs: Iterable[str]) -> None:
    """Load the config's ``[domains] plugins`` (``module:attr`` or ``module``); PluginError naming a bad one."""
    for spec in specs:
        DOMAINS.load(spec)


@dataclasses.dataclass(frozen=True, slots=True)
class RewardBreakdown:
    """The terms of one sample's reward; ``total`` is what the advantage is computed from."""

    correctness: float
    format: float
    tokens: int
    total: float


def score(domain: str, facts: Facts, completion: Completion | str, cfg: RewardConfig | None = None,
          *, verifier: str | None = None) -> RewardBreakdown:
    """Reward of one completion with its terms.

    The correctness function is the registered domain's (or, for an unregistered domain, the ``verifier``'s).
    ``generated_tokens`` counts model tokens (loss mask) of a Completion, or characters of a plain text
    (the default tokenizer is character-level).
    """
    cfg = cfg or RewardConfig()
    text = completion.text if isinstance(completion, Completion) else completion
    registered = DOMAINS.get(domain)
    fn = registered.reward if registered is not None else VERIFIER_REWARDS.get(verifier) if verifier else None
    if fn is None:
        raise KeyError(f"no reward function for domain {domain!r} (verifier {verifier!r}); "
                       f"domains: {sorted(DOMAINS)}, verifiers: {sorted(VERIFIER_REWARDS)}")
    correctness = fn(facts, text)
    fmt = 0.0
    if cfg.format_weight:
        fmt_fn = registered.format_score if registered is not None else None
        fmt = fmt_fn(text) if fmt_fn is not None else 0.0
    tokens = int(completion.loss_mask.sum()) if isinstance(completion, Completion) else len(text)
    total = correctness + cfg.format_weight * fmt - cfg.length_penalty * tokens
    return RewardBreakdown(correctness=correctness, format=fmt, tokens=tokens, total=total)


def reward_fn(domain: str, facts: Facts, completion: Completion | str, cfg: RewardConfig | None = None,
              *, verifier: str | None = None) -> float:
    """The scalar reward of one completion (see :func:`score` for the terms)."""
    return score(domain, facts, completion, cfg, verifier=verifier).total
