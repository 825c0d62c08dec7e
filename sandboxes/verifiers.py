"""Verifiers: turn a completion into outcome facts (not a reward) for each domain.

Each is ``async verify(completion_text, spec, pool_or_sandbox) -> dict``:

- ``answer``: the final answer against ``spec["answer"]``; no sandbox.
- ``code``: the model's program as ``solution.py``, then (after the model's turn) each test in its own
  process. A test passes only if the runner prints a per-test random nonce after the test module ran
  without an exception. The runner and tests live in /verify, which sandboxed code cannot change; the
  nonce reaches the runner through stdin, which the runner consumes before importing anything of the
  model's. Exiting 0 early, deleting or editing tests, writing result files or patching ``os``/``sys``
  therefore scores nothing. (Code running in the runner's process could still dig the nonce out of
  its memory; that takes deliberate introspection, not a shortcut.)
- ``terminal``: a multi-turn shell episode (:class:`TerminalEpisode`) judged by checks of the final state.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sandboxes.base import ExecResult, Sandbox
from sandboxes.pool import SandboxPool
from sandboxes.session import SandboxSession

Facts = dict[str, Any]
SandboxSource = SandboxPool | Sandbox | None

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


@contextlib.asynccontextmanager
async def _hold(source: SandboxSource) -> AsyncIterator[Sandbox]:
    if isinstance(source, SandboxPool):
        async with source.acquire() as sandbox:
            yield sandbox
    elif isinstance(source, Sandbox):
        yield source
    else:
        raise TypeError("this verifier needs a SandboxPool or a Sandbox")


# -- answer -----------------------------------------------------------------------------------------


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """``\\boxed{X}`` if present, else the last ``Answer: X`` line, else the last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    answers = re.findall(r"(?im)^\s*\**(?:final\s+)?answer\**\s*[:=]\s*(.+?)\s*$", text)
    if answers:
        return answers[-1].strip().rstrip(".").strip("*$ ")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    cleaned = text.strip().strip("$").replace(",", "").replace(" ", "")
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/", 1)
            return float(num) / float(den)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(extracted: str, expected: str) -> bool:
    """Numbers compare by value (``4.0 == 4``, ``1,000 == 1000``), anything else as stripped text."""
    a, b = _as_number(extracted), _as_number(expected)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return extracted.strip().strip("$").strip().lower() == expected.strip().strip("$").strip().lower()


_FIRST_INT = re.compile(r"-?\d+")
_FIRST_WORD = re.compile(r"[A-Za-z]+")
MATCH_RULES = ("last", "first_number", "first_word", "first_choice")
"""``spec["match"]``: where the answer is read. ``last`` (default): ``\\boxed{}``, an ``Answer:`` line or the last
number; ``first_number``: the first integer (a prompt that asks for just the number gets no credit for a
right number after a wrong one); ``first_word``: the first word, case-insensitive; ``first_choice``: the first word
that is one of ``spec["choices"]`` (an answer that names a wrong candidate before the right one is wrong)."""


def extract_answer_by(text: str, rule: str, choices: Any = ()) -> str | None:
    """The answer in ``text`` under one of :data:`MATCH_RULES`."""
    if rule == "first_choice":
        allowed = {str(c).lower() for c in choices or ()}
        return next((w for w in (m.lower() for m in _FIRST_WORD.findall(text)) if w in allowed), None)
    if rule == "first_number":
        m = _FIRST_INT.search(text)
        return m.group(0) if m else None
    if rule == "first_word":
        m = _FIRST_WORD.search(text)
        return m.group(0).lower() if m else None
    if rule == "last":
        return extract_answer(text)
    raise ValueError(f"spec.match must be one of {MATCH_RULES}, got {rule!r}")


async def verify_answer(completion_text: str, spec: dict[str, Any], pool_or_sandbox: SandboxSource = None) -> Facts:
    extracted = extract_answer_by(completion_text, str(spec.get("match", "last")), spec.get("choices"))
    correct = extracted is not None and answers_match(extracted, str(spec["answer"]))
    return {"extracted": extracted, "correct": correct}


# -- code -------------------------------------------------------------------------------------------

RUNNER = r'''
import os, sys, runpy
nonce = sys.stdin.readline().strip()
devnull = os.open("/dev/null", os.O_RDONLY)
os.dup2(devnull, 0)
verdict_fd = os.dup(1)
write, exit_now = os.write, os._exit
sys.path.insert(0, "/work")
passed = False
try:
    runpy.run_path(sys.argv[1], run_name="__main__")
    passed = True
except BaseException:
    import traceback
    traceback.print_exc()
if passed:
    sys.stdout.flush()
    write(verdict_fd, ("\n" + nonce + "\n").encode())
    exit_now(0)
exit_now(1)
'''


def extract_program(text: str) -> str:
    """The last ```python fenced block (or last fenced block of any language), else the whole text."""
    blocks = re.findall(r"```(?:python|py)[^\n]*\n(.*?)```", text, flags=re.S)
    if not blocks:
        blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    return blocks[-1] if blocks else text


async def verify_code(completion_text: str, spec: dict[str, Any], pool_or_sandbox: SandboxSource) -> Facts:
    tests = spec["tests"]
    timeout = float(spec.get("timeout_s", 5))
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    async with _hold(pool_or_sandbox) as sandbox:
        await sandbox.write_files({"solution.py": extract_program(completion_text)})
        # The model's turn is over: only now do the runner and the tests enter the sandbox.
        protected: dict[str, str | bytes] = {"runner.py": RUNNER}
        for i, test in enumerate(tests):
            protected[f"tests/test_{i}.py"] = test["code"]
        await sandbox.write_protected_files(protected)
        for i, test in enumerate(tests):
            nonce = secrets.token_hex(16)
            result = await sandbox.exec(
                ["python3", "-I", "/verify/runner.py", f"/verify/tests/test_{i}.py"],
                stdin=(nonce + "\n").encode(),
                timeout=timeout,
            )
            passed = result.exit_code == 0 and not result.timed_out and nonce in result.stdout.splitlines()
            results.append(
                {
                    "name": test.get("name", f"test_{i}"),
                    "passed": passed,
                    "exit_code": result.exit_code,
                    "timed_out": result.timed_out,
                }
            )
    return {
        "passed": sum(r["passed"] for r in results),
        "total": len(tests),
        "tests": results,
        "exit_codes": [r["exit_code"] for r in results],
        "duration_s": time.perf_counter() - start,
    }


# -- terminal ---------------------------------------------------------------------------------------

OBSERVATION_BYTES = 16 * 1024


class TerminalEpisode:
    """A multi-turn shell episode: ``await open()``, ``await step(cmd)`` per model turn, ``await finish()``.

    Holds one sandbox (from a pool, released at finish) for the whole episode.
    """

    def __init__(self, spec: dict[str, Any], pool_or_sandbox: SandboxPool | Sandbox) -> None:
        self.spec = spec
        self.source = pool_or_sandbox
        self.max_turns = int(spec.get("max_turns", 8))
        self.turns = 0
        self._stack = contextlib.AsyncExitStack()
        self.session: SandboxSession | None = None
        self.last_result: ExecResult | None = None
        """The result of the latest :meth:`step` (None before the first, or after ``max_turns``)."""

    async def open(self) -> None:
        sandbox = await self._stack.enter_async_context(_hold(self.source))
        if self.spec.get("setup_files"):
            await sandbox.write_files(self.spec["setup_files"])
        self.session = SandboxSession(sandbox)

    @property
    def done(self) -> bool:
        return self.turns >= self.max_turns

    async def step(self, command: str) -> str:
        """Run one model turn; the observation is its stdout and stderr, capped."""
        if self.session is None:
            raise RuntimeError("TerminalEpisode.open() first")
        if self.done:
            self.last_result = None
            return f"[episode over: max_turns={self.max_turns} reached]"
        self.turns += 1
        result = await self.session.run(command, timeout=self.spec.get("timeout_s"))
        self.last_result = result
        text = result.stdout + result.stderr
        if len(text) > OBSERVATION_BYTES or result.truncated:
            text = text[:OBSERVATION_BYTES] + "\n[output truncated]"
        if result.timed_out:
            text += "\n[command timed out]"
        return text

    async def finish(self) -> Facts:
        """Run the checks against the final state, release the sandbox, return the facts."""
        if self.session is None:
            raise RuntimeError("TerminalEpisode.open() first")
        try:
            checks = self.spec.get("checks", [])
            passed = 0
            for check in checks:
                result = await self.session.sandbox.exec(check["cmd"], timeout=check.get("timeout_s", 10))
                passed += result.exit_code == 0 and not result.timed_out
            return {"checks_passed": passed, "checks_total": len(checks), "turns": self.turns}
        finally:
            await self._stack.aclose()

    async def abandon(self) -> None:
        """Release the sandbox without running the checks (an idle or orphaned episode). Idempotent."""
        await self._stack.aclose()


def extract_commands(text: str) -> list[str]:
    """Turns of a single-text terminal completion: each ```bash/sh block, else each non-empty line."""
    blocks = re.findall(r"```(?:bash|sh|shell|console)?[^\n]*\n(.*?)```", text, flags=re.S)
    if blocks:
        return [b.strip() for b in blocks if b.strip()]
    return [line.strip() for line in text.splitlines() if line.strip()]


async def verify_terminal(completion_text: str, spec: dict[str, Any], pool_or_sandbox: SandboxSource) -> Facts:
    if pool_or_sandbox is None:
        raise TypeError("the terminal verifier needs a SandboxPool or a Sandbox")
    episode = TerminalEpisode(spec, pool_or_sandbox)
    await episode.open()
    try:
        for command in extract_commands(completion_text):
            if episode.done:
                break
            await episode.step(command)
    finally:
        facts = await episode.finish()
    return facts


Verifier = Callable[[str, dict[str, Any], SandboxSource], Awaitable[Facts]]
VERIFIERS: dict[str, Verifier] = {"answer": verify_answer, "code": verify_code, "terminal": verify_terminal}
