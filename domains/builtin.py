"""The built-in generated domains: seeded templates for the character-level fixture and for instruct models.

Two sets, each a plain :class:`~domains.base.Domain` registered with one call:

- ``arith``, ``code``, ``terminal`` (tag ``char``): tiny and templated on purpose, for the character-level
  model trained on CPU in minutes. Every completion is one line per turn and ends with ``stop`` (a newline).
- ``math``, ``python``, ``shell``, ``docqa`` (tag ``chat``): natural-language tasks for a pretrained chat
  model (SmolLM2-135M-Instruct is the reference), rendered with its chat template; generation ends at the
  model's end-of-turn token. Each verifier is strict about the answer format the prompt asks for.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from typing import Any

from domains.base import (STOP, Domain, GeneratedTask, answer_reward, code_reward, register_domain,
                                 terminal_reward)

CHAR = frozenset({"char"})
CHAT = frozenset({"chat"})


# -- arith -------------------------------------------------------------------------------------------

def make_arith(rng: random.Random, difficulty: float) -> GeneratedTask:
    """``"12+7="`` -> ``"19"``. Difficulty adds digits (1 to 3), then ``-``, then ``*``, then a third operand.

    Answers are never negative (a minus sign is one more thing for a tiny model to learn).
    """
    digits = 1 + round(2 * difficulty)
    ops = "+" if difficulty < 0.3 else "+-" if difficulty < 0.6 else "+-*"
    n_operands = 3 if difficulty >= 0.9 else 2
    while True:
        terms = [rng.randrange(0, 10 ** digits)]
        chosen = [rng.choice(ops) for _ in range(n_operands - 1)]
        terms += [rng.randrange(0, 10 if op == "*" else 10 ** digits) for op in chosen]
        value = _evaluate(terms, chosen)
        if value >= 0:
            break
    expr = str(terms[0]) + "".join(f"{op}{t}" for op, t in zip(chosen, terms[1:]))
    return GeneratedTask(prompt=f"{expr}=", spec={"answer": str(value)}, ideal=f"{value}{STOP}")


def _evaluate(terms: list[int], ops: list[str]) -> int:
    """``terms[0] ops[0] terms[1] ...`` with ``*`` binding tighter than ``+``/``-``."""
    products, signs = [terms[0]], [1]
    for op, term in zip(ops, terms[1:]):
        if op == "*":
            products[-1] *= term
        else:
            products.append(term)
            signs.append(1 if op == "+" else -1)
    return sum(s * p for s, p in zip(signs, products))


_INT = re.compile(r"-?\d+")


def answer_format(text: str) -> float:
    """1 when the completion is a bare integer (optionally newline-terminated)."""
    return 1.0 if _INT.fullmatch(text.strip()) else 0.0


# -- code --------------------------------------------------------------------------------------------

_CODE_TEMPLATES: tuple[tuple[float, str, str, Callable[[int, int], int]], ...] = (
    # (min difficulty, description with {k}, body with {k}, reference)
    (0.0, "add {k}", "x+{k}", lambda x, k: x + k),
    (0.0, "subtract {k}", "x-{k}", lambda x, k: x - k),
    (0.0, "multiply by {k}", "x*{k}", lambda x, k: x * k),
    (0.4, "square then add {k}", "x*x+{k}", lambda x, k: x * x + k),
    (0.4, "max of x and {k}", "max(x,{k})", lambda x, k: max(x, k)),
    (0.7, "x mod {k}", "x%{k}", lambda x, k: x % k),
    (0.7, "double then subtract {k}", "2*x-{k}", lambda x, k: 2 * x - k),
)
CODE_TEST_INPUTS = 3


def make_code(rng: random.Random, difficulty: float) -> GeneratedTask:
    """``"# write f: add 3\\n"`` -> ``"def f(x): return x+3"``; tests call ``f`` on a few inputs."""
    templates = [t for t in _CODE_TEMPLATES if t[0] <= difficulty]
    _, describe, body, reference = rng.choice(templates)
    k = rng.randint(1, 29 if difficulty < 0.5 else 99)
    xs = rng.sample(range(-5 if difficulty >= 0.5 else 0, 12), CODE_TEST_INPUTS)
    tests = [{"name": f"f({x})", "code": f"from solution import f\nassert f({x}) == {reference(x, k)}\n"}
             for x in xs]
    return GeneratedTask(prompt=f"# write f: {describe.format(k=k)}\n",
                         spec={"tests": tests, "timeout_s": 5},
                         ideal=f"def f(x): return {body.format(k=k)}{STOP}")


def code_format(text: str) -> float:
    """1 when the completion parses as Python and defines ``f``."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return 0.0
    return 1.0 if any(isinstance(n, ast.FunctionDef) and n.name == "f" for n in tree.body) else 0.0


# -- terminal ----------------------------------------------------------------------------------------

_FILES = tuple("abcdefgh")
_WORDS = ("hi", "ok", "yes", "no", "go", "up")
_DIRS = ("d", "out", "tmp2", "x")
SHELL_COMMANDS = frozenset({"echo", "printf", "rm", "mkdir", "cp", "mv", "touch", "cat", "ls", "cd"})


def _check(cmd: str) -> dict[str, Any]:
    return {"cmd": cmd, "timeout_s": 5}


def _step_create(rng: random.Random, taken: set[str]) -> tuple[str, str, list[dict[str, Any]], dict[str, str]]:
    name = f"{rng.choice([f for f in _FILES if f not in taken])}.txt"
    word = rng.choice(_WORDS)
    taken.add(name[0])
    return (f"create {name} containing {word}", f"echo {word} > {name}",
            [_check(f'test "$(cat {name})" = {word}')], {})


def _step_delete(rng: random.Random, taken: set[str]) -> tuple[str, str, list[dict[str, Any]], dict[str, str]]:
    name = f"{rng.choice([f for f in _FILES if f not in taken])}.txt"
    taken.add(name[0])
    return f"delete {name}", f"rm {name}", [_check(f"test ! -e {name}")], {name: "old\n"}


def _step_mkdir(rng: random.Random, taken: set[str]) -> tuple[str, str, list[dict[str, Any]], dict[str, str]]:
    name = rng.choice([d for d in _DIRS if d not in taken])
    taken.add(name)
    return f"make directory {name}", f"mkdir {name}", [_check(f"test -d {name}")], {}


def _step_transfer(rng: random.Random, taken: set[str], *,
                   move: bool) -> tuple[str, str, list[dict[str, Any]], dict[str, str]]:
    """Copy (or, with ``move``, rename) a set-up file to a new name: the word it holds must arrive there."""
    src, dst = rng.sample([f for f in _FILES if f not in taken], 2)
    taken.update((src, dst))
    word = rng.choice(_WORDS)
    verb, cmd, src_check = ("rename", "mv", "test ! -e") if move else ("copy", "cp", "test -e")
    return (f"{verb} {src}.txt to {dst}.txt", f"{cmd} {src}.txt {dst}.txt",
            [_check(f'test "$(cat {dst}.txt)" = {word}'), _check(f"{src_check} {src}.txt")], {f"{src}.txt": f"{word}\n"})


def _step_copy(rng: random.Random, taken: set[str]) -> tuple[str, str, list[dict[str, Any]], dict[str, str]]:
    return _step_transfer(rng, taken, move=False)


def _step_move(rng: random.Random, taken: set[str]) -> tuple[str, str, list[dict[str, Any]], dict[str, str]]:
    return _step_transfer(rng, taken, move=True)


_TERMINAL_STEPS = (_step_create, _step_delete, _step_mkdir, _step_copy, _step_move)


def _chain_goals(rng: random.Random, n_goals: int) -> tuple[list[str], list[str], list[dict[str, Any]], dict[str, str]]:
    """``n_goals`` shell goals on distinct files: their descriptions, commands, final-state checks and setup files."""
    taken: set[str] = set()
    goals, commands, checks, setup = [], [], [], {}
    for _ in range(n_goals):
        goal, command, goal_checks, files = rng.choice(_TERMINAL_STEPS)(rng, taken)
        goals.append(goal)
        commands.append(command)
        checks.extend(goal_checks)
        setup.update(files)
    return goals, commands, checks, setup


def make_terminal(rng: random.Random, difficulty: float) -> GeneratedTask:
    """``"# goal: create a.txt containing hi\\n$ "`` -> ``"echo hi > a.txt"``; one command per turn.

    Difficulty chains goals (1 to 3), each needing one command; ``max_turns`` leaves one spare turn.
    """
    n_goals = 1 + round(2 * difficulty * 0.99)
    goals, commands, checks, setup = _chain_goals(rng, n_goals)
    spec = {"setup_files": setup, "checks": checks, "max_turns": n_goals + 1}
    return GeneratedTask(prompt=f"# goal: {', then '.join(goals)}\n$ ", spec=spec,
                         ideal="".join(f"{c}{STOP}" for c in commands))


def terminal_format(text: str) -> float:
    """Fraction of non-empty lines that start with a known shell command."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return 0.0
    return sum(ln.split()[0] in SHELL_COMMANDS for ln in lines) / len(lines)


# == domains for instruct models ======================================================================
# Natural-language tasks for a pretrained chat model (SmolLM2-135M-Instruct is the reference): the
# inference actor renders each prompt with the model's chat template, and generation ends at the
# model's end-of-turn token (no stop string). Each verifier is strict about the answer format the prompt
# asks for; the reward counts what the task asked, the format score how exactly it was given.

ANSWER_NUMBER = "Answer with just the number."


def make_math(rng: random.Random, difficulty: float) -> GeneratedTask:
    """``"What is 7 * 8? Answer with just the number."`` -> ``"56"``.

    Difficulty 0 is one-digit operands (1-9) with ``+ - *``: the plain GRPO loop's task
    (``shared/baselines/grpo_minimal.py``), so the two can be compared on the same distribution. From 0.5 the
    operands have two digits; from 0.9 a third operand joins.
    """
    high = 9 if difficulty < 0.5 else 99
    ops = [rng.choice("+-*")]
    terms = [rng.randint(1, high), rng.randint(1, high)]
    if difficulty >= 0.9:
        ops.append(rng.choice("+-"))
        terms.append(rng.randint(1, high))
    value = _evaluate(terms, ops)
    expr = str(terms[0]) + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:]))
    return GeneratedTask(prompt=f"What is {expr}? {ANSWER_NUMBER}", spec={"answer": str(value), "match": "first_number"},
                         ideal=str(value))


_PY_TASKS: tuple[tuple[float, str, str, Callable[[int, int], int]], ...] = (
    (0.0, "returns x plus {k}", "x + {k}", lambda x, k: x + k),
    (0.0, "returns x minus {k}", "x - {k}", lambda x, k: x - k),
    (0.0, "returns x times {k}", "x * {k}", lambda x, k: x * k),
    (0.4, "returns the larger of x and {k}", "max(x, {k})", lambda x, k: max(x, k)),
    (0.4, "returns x squared plus {k}", "x * x + {k}", lambda x, k: x * x + k),
    (0.7, "returns the remainder of x divided by {k}", "x % {k}", lambda x, k: x % k),
)


def make_python(rng: random.Random, difficulty: float) -> GeneratedTask:
    """``"Write a Python function f(x) that returns x plus 3. ..."`` -> a ``def f(x)``; tests run in the sandbox."""
    _, describe, body, reference = rng.choice([t for t in _PY_TASKS if t[0] <= difficulty])
    k = rng.randint(2, 29 if difficulty < 0.5 else 99)
    xs = rng.sample(range(-5, 15), CODE_TEST_INPUTS)
    tests = [{"name": f"f({x})", "code": f"from solution import f\nassert f({x}) == {reference(x, k)}\n"} for x in xs]
    prompt = (f"Write a Python function f(x) that {describe.format(k=k)}. "
              "Answer with only the code, in a ```python block.")
    return GeneratedTask(prompt=prompt, spec={"tests": tests, "timeout_s": 5},
                         ideal=f"```python\ndef f(x):\n    return {body.format(k=k)}\n```")


def fenced_code_format(text: str) -> float:
    """1 when the answer is one fenced Python block defining ``f`` (and nothing outside it)."""
    m = re.fullmatch(r"```(?:python|py)\n(.*?)```", text.strip(), flags=re.S)
    if m is None or "```" in m.group(1):
        return 0.0
    return code_format(m.group(1))


def make_shell(rng: random.Random, difficulty: float) -> GeneratedTask:
    """``"... write the shell command that creates a.txt containing hi ..."``; the command runs in a sandbox."""
    n_goals = 1 + round(difficulty)
    goals, commands, checks, setup = _chain_goals(rng, n_goals)
    listing = ", ".join(sorted(setup)) or "nothing"
    prompt = (f"You are in a Linux shell in a directory that holds {listing}. "
              f"Write the shell command{'s' if n_goals > 1 else ''} to {', then '.join(goals)}. "
              "Answer with only the command, one per line.")
    spec = {"setup_files": setup, "checks": checks, "max_turns": n_goals}
    return GeneratedTask(prompt=prompt, spec=spec, ideal="\n".join(commands))


def shell_format(text: str) -> float:
    """Fraction of lines that are a known shell command (no prose, no fences)."""
    return terminal_format(text)


_NAMES = ("Tom", "Ana", "Sam", "Mia", "Leo", "Ivy", "Max", "Zoe")
_THINGS = ("ball", "kite", "hat", "bike", "cup", "book")
_COLOURS = ("red", "blue", "green", "yellow", "black", "white")
_PLACES = ("garden", "kitchen", "school", "park", "library", "beach")


def make_docqa(rng: random.Random, difficulty: float) -> GeneratedTask:
    """A short passage of facts and a question whose one-word answer is in it.

    Correct when the first colour or place the answer names (of those in the passage) is the right one; the
    format score asks for the single word and nothing else."""
    people = rng.sample(_NAMES, 2 + round(2 * difficulty))
    facts, questions = [], []
    for person in people:
        thing, colour, place = rng.choice(_THINGS), rng.choice(_COLOURS), rng.choice(_PLACES)
        facts.append(f"{person} has a {colour} {thing} and goes to the {place} every day.")
        questions.append((f"What colour is {person}'s {thing}?", colour))
        questions.append((f"Where does {person} go every day?", place))
    question, answer = rng.choice(questions)
    prompt = f"Passage: {' '.join(facts)}\nQuestion: {question} Answer with one word from the passage."
    choices = sorted({w for fact in facts for w in fact.rstrip(".").split() if w in _COLOURS or w in _PLACES})
    return GeneratedTask(prompt=prompt, spec={"answer": answer, "match": "first_choice", "choices": choices},
                         ideal=answer)


def one_word_format(text: str) -> float:
    """1 when the answer is a single word (a final full stop allowed)."""
    return 1.0 if re.fullmatch(r"[A-Za-z]+\.?", text.strip()) else 0.0


register_domain(Domain("arith", "answer", make_arith, answer_reward, answer_format, tags=CHAR,
                       description="one-line integer arithmetic ('12+7=')"))
register_domain(Domain("code", "code", make_code, code_reward, code_format, tags=CHAR,
                       description="one-line Python function f(x), tests in the sandbox"))
register_domain(Domain("terminal", "terminal", make_terminal, terminal_reward, terminal_format, max_turns=4,
                       tags=CHAR, description="shell goals, one command per turn, final state checked"))
register_domain(Domain("math", "answer", make_math, answer_reward, answer_format, stop=(), max_new_tokens=8,
                       tags=CHAT, description="one-digit + - * word problems, answer with just the number"))
register_domain(Domain("python", "code", make_python, code_reward, fenced_code_format, stop=(), max_new_tokens=64,
                       tags=CHAT, description="a Python function f(x) in a fenced block, tests in the sandbox"))
register_domain(Domain("shell", "terminal", make_shell, terminal_reward, shell_format, stop=(), max_new_tokens=24, episode="shell",
                       tags=CHAT, description="shell commands for file goals, final state checked in the sandbox"))
register_domain(Domain("docqa", "answer", make_docqa, answer_reward, one_word_format, stop=(), max_new_tokens=8,
                       tags=CHAT, description="a short passage and a one-word question about it"))
