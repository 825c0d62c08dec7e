"""reasoning-gym's procedural datasets as the domain family ``rg:NAME`` (``rg:chain_sum``, ``rg:leg_counting``, ...).

reasoning-gym (``pip install 'rollout-engine[domains]'``) ships about a hundred seeded generators, each with
its own scorer. Every dataset that passes the checks below is a :class:`~domains.base.Domain` named
``rg:<dataset>``, resolved on first use (nothing is imported until a name is looked up or listed, and the
engine starts without the package: the names are then listed as unavailable with the install hint).

- **tasks**: ``difficulty`` in [0, 1] maps onto the dataset's curriculum levels
  (``round(difficulty * (levels - 1))``; a dataset without a curriculum has one level, its default config).
  One dataset object is built per (name, level) with the fixed seed :data:`SEED` and :data:`SIZE` items,
  and a task is ``entry = ds[rng.randrange(size)]``: deterministic given the ``rng``, in every process.
  Prompt: the entry's question plus an answer instruction (:func:`instruction`). ``spec = {"dataset", "entry", "level",
  "max_new_tokens"}`` (the entry made MessagePack-safe: specs travel over Kafka); the ideal completion is the
  entry's own answer.
- **verifier**: in process (no sandbox), with the dataset's own scorer (``get_score_answer_fn``) run in a
  worker thread under a deadline of :data:`SCORE_TIMEOUT_S`; a timeout or an exception is a failed answer
  with ``error`` in the facts (and counted in :data:`SCORER_FAILURES`), never a crash. Extraction is lenient
  for small chat models: the last ``<answer>...</answer>``, ``\\boxed{}``, what follows "the answer is", the
  whole reply, its last non-empty line and, for an item whose answer is an integer, the last integer in the
  reply (the ``math`` domain's rule) are each scored and the best is kept (:func:`candidates`); nothing else
  is pulled out of a longer string (a scorer's partial credit for a reply that contains the answer among
  other words is not 1.0, so it earns nothing).
- **reward**: binarised, 1.0 iff the scorer gives exactly 1.0 (``facts["score"]`` keeps the raw score: some
  scorers give 0.01 to 0.8 as partial credit or a format floor).
- **held-out split**: the default stable prompt hash, so training and held-out prompts never coincide.

Excluded datasets (:data:`EXCLUDED`, listed as unavailable with why) and level caps (:data:`LEVEL_CAPS`)
come from checks run against reasoning-gym 0.1.25: a dataset must generate items at a level in well under a
second or two, and its own answer must score 1.0 after a MessagePack round trip of the entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import math
import random
import re
import threading
from collections.abc import Callable
from typing import Any

from domains.base import DOMAINS, Domain, Facts, GeneratedTask, answer_reward

PREFIX = "rg"
DISTRIBUTION = "reasoning-gym"
INSTALL_HINT = "reasoning-gym is not installed (pip install 'rollout-engine[domains]')"
SEED = 20241206
"""Seed of every dataset object: item ``i`` of a (dataset, level) is the same in every process."""
SIZE = 1_000_000
SIZES = {"acre": 2000}
"""Datasets that build all their items up front (acre: 0.7 s for 2000; 10**6 would take minutes)."""
SCORE_TIMEOUT_S = 5.0
SCORER_BUILD_TIMEOUT_S = 60.0
"""Building a scorer (once per dataset and process: a default-config dataset object) may take longer."""
MAX_HUNG_SCORERS = 8
"""Scorer threads still running past their deadline; beyond this, answers are failed without scoring."""
BUDGET_SAMPLES = 4
GENERATION_TRIES = 20
MIN_NEW_TOKENS = 32
MAX_NEW_TOKENS = 4096
INSTRUCTION = "Give just the answer, in the format the question asks for."
NUMBER_INSTRUCTION = "Answer with just the number."
"""The line after the question: the number one when the oracle answer is an integer (SmolLM2-135M-Instruct,
sampled at T=1 on 12 chain_sum tasks x 2: 2 of 24 right with it, 0 with a longer generic instruction), else the
generic one. A function of the item alone, so every process renders the same prompt."""
_INTEGER = re.compile(r"-?\d+")


def _is_integer(entry: dict[str, Any]) -> bool:
    """Whether an item's oracle answer is one integer (its prompt asks for just the number)."""
    return _INTEGER.fullmatch(str(entry.get("answer", "")).strip()) is not None


def instruction(entry: dict[str, Any]) -> str:
    """The answer instruction for one item (see :data:`NUMBER_INSTRUCTION`)."""
    return NUMBER_INSTRUCTION if _is_integer(entry) else INSTRUCTION

SCORER_FAILURES: dict[str, int] = {"timeout": 0, "error": 0}
"""Scorer calls that timed out or raised, in this process (each one is a failed answer with ``error``)."""

_HASH_SEED = ("its items depend on PYTHONHASHSEED (set iteration order): not reproducible across processes, "
              "so the actors and the evaluation would see different tasks for the same seed")
_NO_ORACLE = "its items have no oracle answer (answer is None; only a validity check): no ideal, no sanity check"
_ROUND_TRIP = ("its items no longer score their own answer after a JSON or MessagePack round trip "
               "(specs travel over Kafka as MessagePack)")
EXCLUDED: dict[str, str] = {
    "game_of_life_halting": "its scorer gives 1.0 to any non-empty string (it compares bool(answer) with bool(oracle))",
    "boxnet": _NO_ORACLE,
    "graph_color": _NO_ORACLE,
    "rubiks_cube": _NO_ORACLE,
    "rush_hour": _NO_ORACLE,
    "arc_agi": _ROUND_TRIP,
    "rearc": _ROUND_TRIP,
    "isomorphic_strings": _HASH_SEED,
    "knight_swap": _HASH_SEED,
    "polynomial_multiplication": _HASH_SEED,
    "ransom_note": _HASH_SEED,
    "word_ladder": _HASH_SEED,
    "codeio": _HASH_SEED + " (3 of 24 items checked here changed between two hash seeds, answers included)",
    "composite": "a mixture of other datasets, not a dataset (mix rg:NAME domains with scheduler.domains weights)",
    "sokoban": "item generation has no time bound: at levels 0, 10 and 11 single items took over 20 s (puzzle search)",
}
"""Datasets never offered, with why (``rollout domains list`` shows the reason)."""

LEVEL_CAPS: dict[str, tuple[int, str]] = {
    "caesar_cipher": (1, "levels 2+ build an invalid config (rotation must be in range [1,25])"),
    "survo": (1, "levels 2+ build an invalid config (max_empty must be <= 9)"),
    "jugs": (0, "level 1 items can have no solution (13% of 200: their answer '[\"No solution\"]' scores 0) "
                "and items at levels 2+ take over 8 s each to generate"),
    "zebra_puzzles": (3, "items at levels 4+ take over 8 s each to generate"),
}
"""Highest curriculum level used, with why (higher difficulties stay at the cap)."""

KNOWN_DATASETS = (
    "ab", "acre", "advanced_geometry", "aiw", "arc_1d", "base_conversion", "basic_arithmetic", "bf",
    "binary_alternation", "binary_matrix", "bitwise_arithmetic", "caesar_cipher", "calendar_arithmetic", "chain_sum",
    "circuit_logic", "coin_flip", "color_cube_rotation", "complex_arithmetic", "count_bits", "count_primes",
    "countdown", "course_schedule", "cryptarithm", "decimal_arithmetic", "decimal_chain_sum", "dice",
    "emoji_mystery", "family_relationships", "figlet_font", "fraction_simplification", "futoshiki", "game_of_life",
    "gcd", "group_anagrams", "gsm_symbolic", "intermediate_integration", "jugs", "kakurasu", "knights_knaves",
    "largest_island", "lcm", "leg_counting", "letter_counting", "letter_jumble", "list_functions", "mahjong_puzzle",
    "manipulate_matrix", "maze", "mini_sudoku", "modulo_grid", "n_queens", "needle_haystack", "number_filtering",
    "number_format", "number_sequence", "number_sorting", "palindrome_generation", "palindrome_partitioning",
    "path_star", "polynomial_equations", "pool_matrix", "power_function", "prime_factorization", "products",
    "propositional_logic", "puzzle24", "quantum_lock", "rectangle_count", "rotate_matrix", "rotten_oranges",
    "self_reference", "sentence_reordering", "shortest_path", "simple_equations", "simple_geometry",
    "simple_integration", "spell_backward", "spiral_matrix", "string_insertion", "string_manipulation",
    "string_splitting", "string_synthesis", "sudoku", "survo", "syllogism", "time_intervals", "tower_of_hanoi",
    "tsumego", "word_sequence_reversal", "word_sorting", "zebra_puzzles",
)
"""The usable datasets of reasoning-gym 0.1.25 (listed as unavailable, with the install hint, without it)."""

_TAGS = frozenset({"chat", "reasoning-gym"})
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


# -- the package -------------------------------------------------------------------------------------

@functools.cache
def _package() -> tuple[Any, str] | str:
    """``(reasoning_gym.factory, version)``, or why it cannot be used (imported once, on first need)."""
    try:
        import importlib.metadata

        import reasoning_gym.factory as factory
    except ImportError:
        return INSTALL_HINT
    except Exception as exc:  # the package's own import-time failure: listed, not fatal
        return f"reasoning-gym cannot be imported: {type(exc).__name__}: {exc}"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return factory, version


def _factory() -> Any:
    pkg = _package()
    if isinstance(pkg, str):
        raise KeyError(pkg)
    return pkg[0]


def version() -> str | None:
    """reasoning-gym's installed version, or None when it cannot be imported."""
    pkg = _package()
    return None if isinstance(pkg, str) else pkg[1]


# -- entries -----------------------------------------------------------------------------------------

def wire_safe(obj: Any) -> Any:
    """``obj`` as plain MessagePack data: string map keys, lists for tuples and sets, str for anything else."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): wire_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [wire_safe(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((wire_safe(v) for v in obj), key=repr)
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, int):
        return obj if -(2 ** 63) <= obj < 2 ** 64 else str(obj)
    if isinstance(obj, float):
        return obj
    return str(obj)


def oracle(entry: dict[str, Any]) -> str | None:
    """The entry's own answer (propositional_logic keeps one valid conclusion in ``metadata.example_answer``)."""
    answer = entry.get("answer")
    if answer is None:
        meta = entry.get("metadata")
        answer = meta.get("example_answer") if isinstance(meta, dict) else None
    return None if answer is None else str(answer)


def levels(name: str) -> int:
    """How many difficulty levels ``name`` has here (its curriculum's longest attribute, capped)."""
    factory = _factory()
    count = 1
    if factory.has_curriculum(name):
        attrs = factory.create_curriculum(name).attributes
        count = max((len(a.levels) for a in attrs.values()), default=1)
    cap = LEVEL_CAPS.get(name)
    return min(count, cap[0] + 1) if cap else count


def level_for(name: str, difficulty: float) -> int:
    """The curriculum level of a difficulty in [0, 1] (non-decreasing in difficulty)."""
    d = min(1.0, max(0.0, difficulty))
    return round(d * (levels(name) - 1))


@functools.cache
def dataset(name: str, level: int) -> Any:
    """The dataset object of ``name`` at ``level`` (fixed seed; a level whose config is invalid falls back to
    the highest lower level that builds)."""
    factory = _factory()
    cls, config_cls = factory.DATASETS[name]
    size = SIZES.get(name, SIZE)
    try:
        if factory.has_curriculum(name):
            curriculum = factory.create_curriculum(name)
            curriculum.set_global_level(level)
            config = curriculum.generate_configuration({"seed": SEED, "size": size})
        else:
            config = config_cls(seed=SEED, size=size)
        return cls(config=config)
    except Exception as exc:  # the package's own config checks (AssertionError, ValueError, ...)
        if level > 0:
            return dataset(name, level - 1)
        raise ValueError(f"reasoning-gym dataset {name!r} cannot be built: {type(exc).__name__}: {exc}") from None


def entry_at(name: str, level: int, index: int) -> dict[str, Any]:
    """Item ``index`` of ``name`` at ``level``, MessagePack-safe (some generators print: kept off stdout)."""
    ds = dataset(name, level)
    with contextlib.redirect_stdout(io.StringIO()):
        entry = ds[index % len(ds)]
    safe: dict[str, Any] = wire_safe(entry)
    return safe


def token_budget(answer: str | None) -> int:
    """Generation budget for an answer this long: ~2 characters a token, room for a tag and slack."""
    chars = len(answer or "")
    return max(MIN_NEW_TOKENS, min(MAX_NEW_TOKENS, 8 * math.ceil((chars / 2 + 24) / 8)))


# -- verifying ---------------------------------------------------------------------------------------

@functools.cache
def _cached_scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    fn: Callable[[str | None, dict[str, Any]], float] = _factory().get_score_answer_fn(name)
    return fn


def scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The dataset's own ``score_answer(answer, entry) -> [0, 1]`` (tests replace this lookup)."""
    return _cached_scorer(name)


_SAID = re.compile(r"(?i)\banswer\b(?:[^.:=\n<>]{0,60}?\bis\b\**\s*[:=]?|\**\s*[:=])\s*(.+)")


def _said(text: str) -> str | None:
    """What follows the last "answer is" / "Answer:" on its line (a chat model's usual phrasing), trimmed of
    the closing full stop, quotes and emphasis; None when the reply says no such thing."""
    found = None
    for line in text.splitlines():
        for m in _SAID.finditer(line):
            found = m.group(1)
    if found is None:
        return None
    for _ in range(3):  # '"Yes".', '**42**.', ...: the closing full stop, quotes and emphasis, in any order
        found = found.strip().strip("*`\"'")
        if found.endswith(".") and not found.endswith(".."):
            found = found[:-1]
    return found.strip()


def candidates(text: str, *, integer: bool = False) -> list[str]:
    """What a reply may answer with, in order: the last ``<answer>`` tag's content, the last ``\\boxed{}``, what
    follows its last "answer is" / "Answer:", the whole reply, its last non-empty line, and for an item whose
    answer is an integer (``integer``) the last integer in the reply (stripped, duplicates dropped). Each is
    one reading of the reply as a whole: a number mentioned before the last one is never read as the answer.

    The last integer is the ``math`` domain's rule (and GSM8K's usual "flexible" extraction): SmolLM2-135M-Instruct
    at T=1 mostly states a sum in a sentence ("6 + 1 = 7."), which the other readings miss."""
    from sandboxes.verifiers import _NUMBER, _boxed

    out: list[str] = []
    tags = _ANSWER_TAG.findall(text)
    if tags:
        out.append(tags[-1].strip())
    boxed = _boxed(text)
    if boxed is not None:
        out.append(boxed.strip())
    said = _said(text)
    if said:
        out.append(said)
    out.append(text.strip())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:
        out.append(lines[-1])
    if integer:
        numbers = _NUMBER.findall(text)  # the math domain's numbers: "3.7" stays 3.7, never its last digit "7"
        if numbers:
            out.append(numbers[-1].replace(",", ""))
    return list(dict.fromkeys(c for c in out if c))


_hung = 0
_hung_lock = threading.Lock()


async def _with_deadline(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in its own daemon thread; TimeoutError after ``timeout`` s (the thread is left to finish)."""
    global _hung
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    finished = threading.Event()

    def deliver(ok: bool, value: Any) -> None:
        if not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def work() -> None:
        global _hung
        try:
            ok, value = True, fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            ok, value = False, exc
        with _hung_lock:
            finished.set()
            if timed_out[0]:
                _hung -= 1
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(deliver, ok, value)

    timed_out = [False]
    threading.Thread(target=work, name="rg-scorer", daemon=True).start()
    try:
        return await asyncio.wait_for(future, timeout)
    except TimeoutError:
        with _hung_lock:
            if not finished.is_set():
                timed_out[0] = True
                _hung += 1
        raise


def hung_scorers() -> int:
    """Scorer threads still running past their deadline in this process."""
    return _hung


async def verify_rg(text: str, spec: dict[str, Any], pool: Any = None) -> Facts:
    """Score a reply with its dataset's own scorer: facts ``extracted``, ``score`` (raw), ``correct``
    (score == 1.0) and ``error`` when the scorer failed, timed out or the spec is unusable."""
    name, entry = spec.get("dataset"), spec.get("entry")
    found = candidates(text, integer=isinstance(entry, dict) and _is_integer(entry))
    facts: Facts = {"extracted": found[0] if found else "", "score": 0.0, "correct": False}
    if not isinstance(name, str) or not isinstance(entry, dict):
        facts["error"] = "spec: expected 'dataset' (a name) and 'entry' (a reasoning-gym item)"
        return facts
    if not found:
        return facts
    if _hung >= MAX_HUNG_SCORERS:
        SCORER_FAILURES["error"] += 1
        facts["error"] = f"{_hung} scorer threads are still running past their deadline: not scoring"
        return facts

    try:
        fn = await _with_deadline(functools.partial(scorer, name), SCORER_BUILD_TIMEOUT_S)
        scored = await _with_deadline(lambda: [(float(fn(c, entry)), c) for c in found], SCORE_TIMEOUT_S)
    except TimeoutError:
        SCORER_FAILURES["timeout"] += 1
        facts["error"] = f"the {name} scorer took over {SCORE_TIMEOUT_S:g} s"
        return facts
    except Exception as exc:  # a scorer that raises on free text (prime_factorization, ...) fails the answer
        SCORER_FAILURES["error"] += 1
        facts["error"] = f"the {name} scorer raised {type(exc).__name__}: {str(exc)[:200]}"
        return facts
    best, extracted = max(scored, key=lambda sc: sc[0])  # first of equal scores: the tag, then the whole reply
    facts.update(extracted=extracted, score=best, correct=best == 1.0)
    return facts


def rg_format(text: str) -> float:
    """1 for a reply that is only an answer: an ``<answer>`` tag, or a single non-empty line."""
    stripped = text.strip()
    if not stripped:
        return 0.0
    return 1.0 if _ANSWER_TAG.search(stripped) or "\n" not in stripped else 0.0


# -- the family --------------------------------------------------------------------------------------

def _make_task(name: str) -> Callable[[random.Random, float], GeneratedTask]:
    def make(rng: random.Random, difficulty: float) -> GeneratedTask:
        level = level_for(name, difficulty)
        entry, error = None, None
        for _ in range(GENERATION_TRIES):  # a few generators give up on some items (tsumego, ...): the next draw
            try:
                entry = entry_at(name, level, rng.randrange(SIZES.get(name, SIZE)))
                break
            except Exception as exc:  # the package's own generation failure (RuntimeError, ValueError, ...)
                error = exc
        if entry is None:
            raise RuntimeError(f"reasoning-gym {name} level {level}: {GENERATION_TRIES} items in a row failed to "
                               f"generate (last: {type(error).__name__}: {error})")
        ideal = oracle(entry) or ""
        prompt = f"{str(entry.get('question', '')).rstrip()}\n\n{instruction(entry)}"
        spec = {"dataset": name, "entry": entry, "level": level, "max_new_tokens": token_budget(ideal)}
        return GeneratedTask(prompt=prompt, spec=spec, ideal=ideal)

    make.__qualname__ = make.__name__ = f"make_rg_{name}"
    return make


class ReasoningGymFamily:
    """``rg:NAME`` for every reasoning-gym dataset that passes the checks (module docstring)."""

    prefix = PREFIX

    def names(self) -> list[str]:
        pkg = _package()
        if isinstance(pkg, str):
            return []
        return sorted(n for n in pkg[0].DATASETS if n not in EXCLUDED)

    def unavailable(self) -> dict[str, str]:
        pkg = _package()
        if isinstance(pkg, str):
            return {n: pkg for n in sorted({*KNOWN_DATASETS, *EXCLUDED})}
        return dict(EXCLUDED)

    def resolve(self, name: str) -> Domain:
        factory = _factory()
        if name in EXCLUDED:
            raise KeyError(EXCLUDED[name])
        if name not in factory.DATASETS:
            raise KeyError(f"reasoning-gym {version()} has no dataset {name!r}")
        make = _make_task(name)
        sample = random.Random(SEED)
        longest = max(len(oracle(entry_at(name, 0, sample.randrange(SIZES.get(name, SIZE)))) or "")
                      for _ in range(BUDGET_SAMPLES))
        top = levels(name) - 1
        cap = LEVEL_CAPS.get(name)
        description = f"reasoning-gym {name}, curriculum levels 0..{top}" + (f" (capped: {cap[1]})" if cap else "")
        return Domain(f"{PREFIX}:{name}", verify_rg, make, answer_reward, rg_format, stop=(),
                      max_new_tokens=token_budget("x" * longest), sandbox=False,
                      source=f"reasoning-gym {version()}", description=description, tags=_TAGS)


FAMILY = ReasoningGymFamily()
DOMAINS.add_family(PREFIX, FAMILY, origin=__name__, replace=True)
