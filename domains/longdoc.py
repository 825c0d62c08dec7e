"""The ``longdoc`` domain: questions about long generated documents (1k to 8k tokens).

Why: long-context skill (finding, counting and comparing facts spread over thousands of tokens) is what
sparse attention and context-length curricula are meant to preserve, and it needs tasks whose answers are
checkable without a judge model. Every document is generated in code from a seeded ``random.Random``:

- ``report``: a quarterly report with a units table (product x region); questions extract a cell, count
  rows with a status, or compare two products.
- ``contract``: numbered clauses with parties, amounts and notice periods; questions locate the clause
  that sets a term, or extract an amount.
- ``log``: a service log; questions count a host's errors, or locate the line of a request id.

Length: ``difficulty`` in [0, 1] maps linearly to a target of :data:`MIN_TOKENS` .. :data:`MAX_TOKENS`
tokens (:func:`tokens_for_difficulty`); the document grows until its estimated length reaches the target.
The estimate (:data:`CHARS_PER_TOKEN`, per kind) was calibrated against the SmolLM2 tokenizer (the unit test
checks the real count stays within 35% of the target).

Answer format (strict): one line ``Answer: <value>``, the value an integer or one lowercase word. The
reward is answer accuracy: 1 only when the format is exact and the value is right.

Held-out split: the shared rule of :mod:`domains` (a stable hash of the prompt), so training and
held-out prompts are disjoint whatever the seeds. :func:`longdoc_accuracy` scores any chat
``generate`` callable on held-out tasks of one length (used by the sparse-attention benchmark).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from domains.base import Domain, Facts, GeneratedTask, register_domain
from sandboxes.verifiers import answers_match, extract_answer

MIN_TOKENS = 1000
MAX_TOKENS = 8000
CHARS_PER_TOKEN = {"report": 2.2, "contract": 4.2, "log": 1.8}
"""Characters per SmolLM2 token of each kind of document (measured; digits are one token each)."""
MAX_NEW_TOKENS = 12

_PRODUCTS = ("falcon", "otter", "maple", "cobalt", "willow", "ember", "harbor", "quartz", "saffron",
             "tundra", "juniper", "marlin", "pebble", "zephyr", "lantern", "orchid")
_REGIONS = ("north", "south", "east", "west", "central", "coastal", "highland", "island")
_STATUSES = ("ontrack", "delayed", "cancelled")
_PARTIES = ("supplier", "customer", "carrier", "auditor", "licensor", "licensee")
_TERMS = ("termination notice", "late payment penalty", "warranty period", "audit notice", "delivery window",
          "liability cap")
_HOSTS = tuple(f"host{i:02d}" for i in range(1, 13))
_LEVELS = ("INFO", "INFO", "INFO", "WARN", "ERROR")
_EVENTS = ("request served", "cache refreshed", "connection reset", "disk nearly full", "retrying upstream",
           "token renewed", "batch flushed", "slow query")

_ANSWER_LINE = re.compile(r"Answer: (-?\d+|[a-z]+)")


def tokens_for_difficulty(difficulty: float) -> int:
    """Target document length (tokens) of a difficulty in [0, 1]."""
    d = min(1.0, max(0.0, difficulty))
    return round(MIN_TOKENS + d * (MAX_TOKENS - MIN_TOKENS))


def difficulty_for_tokens(tokens: int) -> float:
    """The difficulty whose documents are ``tokens`` long (the inverse of :func:`tokens_for_difficulty`)."""
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise ValueError(f"longdoc length must be in [{MIN_TOKENS}, {MAX_TOKENS}] tokens, got {tokens}")
    return (tokens - MIN_TOKENS) / (MAX_TOKENS - MIN_TOKENS)


def _grow(make_line: Callable[[int], str], budget_chars: int, start: int = 1) -> list[str]:
    """Lines from ``make_line(i)`` until their total length reaches ``budget_chars``."""
    lines: list[str] = []
    used, i = 0, start
    while used < budget_chars:
        line = make_line(i)
        lines.append(line)
        used += len(line) + 1
        i += 1
    return lines


def _report(rng: random.Random, chars: int) -> tuple[str, str, str]:
    head = f"QUARTERLY OPERATIONS REPORT {rng.randint(2019, 2031)}-Q{rng.randint(1, 4)}\n" \
           "Section 1. Units shipped by product and region (table).\n" \
           "| row | product | region | units | status |\n|---|---|---|---|---|"
    rows: list[tuple[str, str, int, str]] = []
    seen: set[tuple[str, str]] = set()

    def row(i: int) -> str:
        while True:
            product, region = rng.choice(_PRODUCTS), rng.choice(_REGIONS)
            if (product, region) not in seen or len(seen) >= len(_PRODUCTS) * len(_REGIONS):
                break
        seen.add((product, region))
        units, status = rng.randint(100, 9999), rng.choice(_STATUSES)
        rows.append((product, region, units, status))
        return f"| {i} | {product} | {region} | {units} | {status} |"

    table = _grow(row, chars - len(head) - 200)
    kind = rng.choice(("extract", "count", "compare"))
    unique = [r for r in rows if sum(1 for o in rows if o[:2] == r[:2]) == 1]
    pair = rng.sample(unique, 2) if len(unique) >= 2 else None
    if kind == "extract" and unique:
        product, region, units, _ = rng.choice(unique)
        question, answer = f"How many units of {product} were shipped in the {region} region?", str(units)
    elif kind == "compare" and pair and pair[0][2] != pair[1][2]:
        a, b = pair
        more = a if a[2] > b[2] else b
        if a[0] != b[0]:
            question = (f"Which product shipped more units: {a[0]} in the {a[1]} region or {b[0]} in the "
                        f"{b[1]} region? Answer with the product name.")
            answer = more[0]
        else:
            question = f"Which region shipped more units of {a[0]}: {a[1]} or {b[1]}? Answer with the region name."
            answer = more[1]
    else:
        status = rng.choice(_STATUSES)
        question = f"How many table rows have status {status}?"
        answer = str(sum(1 for r in rows if r[3] == status))
    tail = "Section 2. Statuses are ontrack, delayed or cancelled as of the report date."
    return "\n".join([head, *table, tail]), question, answer


def _contract(rng: random.Random, chars: int) -> tuple[str, str, str]:
    a, b = rng.sample(_PARTIES, 2)
    head = f"MASTER SERVICES AGREEMENT between the {a} and the {b}.\nThe clauses below are numbered."
    terms = list(_TERMS)
    rng.shuffle(terms)
    key_term = terms[0]
    values: dict[str, int] = {}
    budget = chars - len(head) - 150
    n_clauses = max(len(terms) + 2, budget // 150)
    placed = rng.sample(range(1, n_clauses + 1), len(terms))
    at = dict(zip(placed, terms))

    def clause(i: int) -> str:
        if i in at:
            term = at[i]
            value = rng.randint(2, 365)
            values[term] = value
            return (f"Clause {i}. The {term} is {value} days unless both parties agree otherwise in writing, "
                    f"and the {rng.choice(_PARTIES)} shall keep a record of it.")
        return (f"Clause {i}. The {rng.choice(_PARTIES)} shall {rng.choice(('notify', 'inform', 'remind'))} "
                f"the {rng.choice(_PARTIES)} of any change to the schedule within a reasonable time, "
                f"and both shall act in good faith.")

    clauses = [clause(i) for i in range(1, n_clauses + 1)]
    if rng.random() < 0.5:
        question, answer = f"Which clause number sets the {key_term}?", str(placed[0])
    else:
        question, answer = f"How many days is the {key_term}?", str(values[key_term])
    return "\n".join([head, *clauses]), question, answer


def _log(rng: random.Random, chars: int) -> tuple[str, str, str]:
    head = "SERVICE LOG (one event per line: line number, time, host, level, event, request id)"
    entries: list[tuple[str, str, str]] = []

    def line(i: int) -> str:
        host, level, req = rng.choice(_HOSTS), rng.choice(_LEVELS), f"r{rng.randint(10000, 99999)}"
        entries.append((host, level, req))
        return (f"{i} 12:{(i // 60) % 60:02d}:{i % 60:02d} {host} {level} {rng.choice(_EVENTS)} "
                f"req={req}")

    lines = _grow(line, chars - len(head) - 150)
    if rng.random() < 0.5:
        host = rng.choice(_HOSTS)
        question = f"How many ERROR lines does {host} have?"
        answer = str(sum(1 for h, lvl, _ in entries if h == host and lvl == "ERROR"))
    else:
        reqs = [r for _, _, r in entries]
        unique = [i for i, r in enumerate(reqs) if reqs.count(r) == 1]
        i = rng.choice(unique)
        question, answer = f"On which line number does request id {reqs[i]} appear?", str(i + 1)
    return "\n".join([head, *lines]), question, answer


_KINDS = {"report": _report, "contract": _contract, "log": _log}


def make_longdoc_tokens(rng: random.Random, tokens: int) -> GeneratedTask:
    """A document of about ``tokens`` tokens with one question (see the module docstring)."""
    kind = rng.choice(sorted(_KINDS))
    document, question, answer = _KINDS[kind](rng, int(tokens * CHARS_PER_TOKEN[kind]))
    prompt = (f"Read the document and answer the question.\n\n<document>\n{document}\n</document>\n\n"
              f"Question: {question}\nReply with exactly one line: Answer: <value> (an integer or one "
              f"lowercase word).")
    return GeneratedTask(prompt=prompt, spec={"answer": answer, "match": "last", "tokens": tokens, "kind": kind},
                         ideal=f"Answer: {answer}")


def make_longdoc(rng: random.Random, difficulty: float) -> GeneratedTask:
    """The domain's generator: ``difficulty`` selects the document length (:func:`tokens_for_difficulty`)."""
    return make_longdoc_tokens(rng, tokens_for_difficulty(difficulty))


def longdoc_format(text: str) -> float:
    """1 when the completion is exactly ``Answer: <integer or lowercase word>`` (one line)."""
    return 1.0 if _ANSWER_LINE.fullmatch(text.strip()) else 0.0


def longdoc_reward(facts: Facts, text: str) -> float:
    """Answer accuracy under the strict format: a right value in any other shape earns nothing."""
    return 1.0 if facts.get("correct") and longdoc_format(text) else 0.0


def is_correct(completion: str, answer: str) -> bool:
    """The reward's verdict without the verifier round trip (what :func:`longdoc_accuracy` uses)."""
    extracted = extract_answer(completion)
    return bool(longdoc_format(completion)) and extracted is not None and answers_match(extracted, answer)


LONGDOC = register_domain(Domain("longdoc", "answer", make_longdoc, longdoc_reward, longdoc_format, stop=(),
                                 max_new_tokens=MAX_NEW_TOKENS, length_to_difficulty=difficulty_for_tokens,
                                 tags=frozenset({"chat", "long-context"}),
                                 description="questions about generated 1k-8k-token documents"))


def longdoc_tasks(n: int, tokens: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` held-out ``(prompt, answer)`` pairs of documents about ``tokens`` long (deterministic for a seed)."""
    difficulty = difficulty_for_tokens(tokens)
    return [(prompt, str(spec["answer"])) for prompt, spec in LONGDOC.heldout(n, seed=seed, difficulty=difficulty)]


def longdoc_accuracy(generate: Callable[[list[dict]], str], n: int, tokens: int, seed: int = 0) -> float:
    """Accuracy of ``generate`` (chat messages -> completion text) on ``n`` held-out tasks of ``tokens`` length.

    Each task is sent as one user message; a completion counts when :func:`is_correct` accepts it.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    tasks = longdoc_tasks(n, tokens, seed)
    right = sum(is_correct(generate([{"role": "user", "content": prompt}]), answer) for prompt, answer in tasks)
    return right / len(tasks)
