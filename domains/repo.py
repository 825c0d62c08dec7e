"""The ``repo`` domain: fix a small Python repository with tools, judged by held-out tests.

Each task is a tiny repository written into the episode's sandbox (``/work``): ``lib.py`` with one buggy
function, ``helpers.py``, a README and a visible test suite in ``tests/`` that fails. The model works over
several turns with the tools of :mod:`engine.tools` (``bash``, ``read_file``, ``write_file``, ``run_tests``):
it reads the failure, edits, runs the tests again. The reward is the pass rate of HELD-OUT tests (other
inputs of the same function, written under /verify where the model cannot read them); a task is completed
when all of them pass (the eval metric is the completion rate).

Tasks come from :data:`TEMPLATES` (one buggy/correct pair of function bodies each, 30+), parameterised by a
constant ``k`` and the test inputs, or from a directory of user-written tasks (:func:`load_task_dir`,
layout in docs/domains.md). Tests are plain ``def test_*`` functions run by a small runner
(:data:`RUNNER`), so the sandbox needs no pytest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import re
import tomllib
from pathlib import Path
from typing import Any

from domains.base import Domain, Facts, GeneratedTask, register_domain
from domains.tool_exec import ToolExecutor
from engine.tools import BUILTIN_TOOLS
from sandboxes.base import ExecResult, Sandbox
from sandboxes.verifiers import _hold

__all__ = ["RUNNER", "RepoEpisode", "RepoTerminalEpisode", "expand_spec", "TEMPLATES", "Template", "load_task_dir", "make_repo", "render_task",
           "repo_format", "repo_reward", "verify_repo"]

RUNNER = '''"""Runs every test_* function of the test_*.py files in a directory; prints a report and a summary."""
import importlib.util, pathlib, sys, traceback
sys.path.insert(0, "/work")
sys.dont_write_bytecode = True
passed = failed = 0
for path in sorted(pathlib.Path(sys.argv[1]).glob("test_*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:
        failed += 1
        print(f"ERROR collecting {path.name}:\\n{traceback.format_exc(limit=2)}")
        continue
    for name in sorted(n for n in vars(module) if n.startswith("test_")):
        try:
            getattr(module, name)()
            passed += 1
        except Exception as exc:
            failed += 1
            print(f"FAILED {path.name}::{name}: {type(exc).__name__}: {exc}")
print(f"SUMMARY passed={passed} failed={failed}")
'''
RUN_VISIBLE = "python3 /verify/run_tests.py /work/tests 2>&1"
RUN_HIDDEN = "python3 /verify/run_tests.py /verify/hidden 2>&1"
_SUMMARY = re.compile(r"SUMMARY passed=(\d+) failed=(\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class Template:
    """A function with a bug: ``good`` and ``bad`` are return expressions over the argument and ``k``."""

    name: str
    kind: str  # the argument: "int" (x), "list" (xs, ints) or "str" (s)
    describe: str
    good: str
    bad: str


_T = Template
TEMPLATES: tuple[Template, ...] = (
    _T("add_k", "int", "x plus {k}", "x + {k}", "x - {k}"),
    _T("mul_k", "int", "x times {k}", "x * {k}", "x + {k}"),
    _T("cap_at_k", "int", "x, but at most {k}", "min(x, {k})", "max(x, {k})"),
    _T("floor_at_k", "int", "x, but at least {k}", "max(x, {k})", "min(x, {k})"),
    _T("is_multiple", "int", "whether x is a multiple of {k}", "x % {k} == 0", "x % {k} == 1"),
    _T("distance_k", "int", "the distance between x and {k}", "abs(x - {k})", "x - {k}"),
    _T("square_plus", "int", "x squared plus {k}", "x * x + {k}", "x * 2 + {k}"),
    _T("div_k", "int", "x integer-divided by {k}", "x // {k}", "x % {k}"),
    _T("sign_times_k", "int", "{k} times the sign of x", "{k} * ((x > 0) - (x < 0))", "{k} * (x > 0)"),
    _T("between", "int", "whether 0 <= x <= {k}", "0 <= x <= {k}", "0 < x < {k}"),
    _T("triangle", "int", "the sum 0 + 1 + ... + x, plus {k}", "max(x, 0) * (max(x, 0) + 1) // 2 + {k}",
       "max(x, 0) * (max(x, 0) - 1) // 2 + {k}"),
    _T("digits", "int", "the number of decimal digits of abs(x) times {k}", "len(str(abs(x))) * {k}",
       "len(str(x)) * {k}"),
    _T("sum_plus", "list", "the sum of xs plus {k}", "sum(xs) + {k}", "sum(xs[1:]) + {k}"),
    _T("count_above", "list", "how many items of xs are greater than {k}", "sum(1 for v in xs if v > {k})",
       "sum(1 for v in xs if v >= {k})"),
    _T("max_or_k", "list", "the largest of the items of xs and {k}", "max(xs + [{k}])", "max(xs[:-1] + [{k}])"),
    _T("min_or_k", "list", "the smallest of the items of xs and {k}", "min(xs + [{k}])", "min(xs[1:] + [{k}])"),
    _T("scaled", "list", "xs with every item times {k}", "[v * {k} for v in xs]", "[v + {k} for v in xs]"),
    _T("filtered", "list", "the items of xs that are less than {k}, in order", "[v for v in xs if v < {k}]",
       "[v for v in xs if v <= {k}]"),
    _T("last_k", "list", "the last {k} items of xs", "xs[-{k}:]", "xs[:{k}]"),
    _T("first_k", "list", "the first {k} items of xs", "xs[:{k}]", "xs[1:{k}]"),
    _T("sorted_desc", "list", "xs sorted from largest to smallest, then {k} appended",
       "sorted(xs, reverse=True) + [{k}]", "sorted(xs) + [{k}]"),
    _T("evens_plus", "list", "the number of even items of xs plus {k}", "sum(1 for v in xs if v % 2 == 0) + {k}",
       "sum(1 for v in xs if v % 2 == 1) + {k}"),
    _T("product_mod", "list", "the product of xs modulo {k}",
       "__import__('math').prod(xs) % {k}", "sum(xs) % {k}"),
    _T("index_of_k", "list", "the index of the first item equal to {k}, or -1",
       "xs.index({k}) if {k} in xs else -1", "xs.index({k}) if {k} in xs else 0"),
    _T("repeat", "str", "s repeated {k} times", "s * {k}", "s * ({k} - 1)"),
    _T("padded", "str", "s with {k} '.' added on the left", "s.rjust(len(s) + {k}, '.')",
       "s.ljust(len(s) + {k}, '.')"),
    _T("shout", "str", "s upper-cased followed by {k} '!'", "s.upper() + '!' * {k}", "s.lower() + '!' * {k}"),
    _T("reversed_cut", "str", "s reversed, without its first {k} characters", "s[::-1][{k}:]", "s[{k}:][::-1]"),
    _T("count_vowels", "str", "the number of vowels (aeiou) in s plus {k}", "sum(c in 'aeiou' for c in s) + {k}",
       "sum(c in 'aei' for c in s) + {k}"),
    _T("caesar", "str", "s with each lowercase letter shifted {k} places forward (wrapping)",
       "''.join(chr((ord(c) - 97 + {k}) % 26 + 97) for c in s)", "''.join(chr(ord(c) + {k}) for c in s)"),
    _T("initials", "str", "the first character of s followed by its length plus {k}",
       "s[:1] + str(len(s) + {k})", "s[-1:] + str(len(s) + {k})"),
    _T("dedupe", "str", "s with repeated characters dropped (first kept) and then {k} '-' appended",
       "''.join(dict.fromkeys(s)) + '-' * {k}", "''.join(sorted(set(s))) + '-' * {k}"),
)

_ARG = {"int": "x", "list": "xs", "str": "s"}
_WORDS = ("apple", "zebra", "banana", "kiwi", "queue", "moon", "tree", "python", "sky", "hello", "xyz", "aaab",
          "mississippi", "elephants", "keyboarding", "rhythmically", "strawberry")


def _inputs(kind: str, rng: random.Random, n: int) -> list[Any]:
    if kind == "int":
        return rng.sample(range(-9, 40), n)
    if kind == "list":
        return [[rng.randint(-5, 12) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    return [rng.choice(_WORDS) for _ in range(n)]


def _function(t: Template, body: str, k: int) -> str:
    return f"def {t.name}({_ARG[t.kind]}):\n    return {body.format(k=k)}\n"


def _reference(t: Template, k: int) -> Any:
    namespace: dict[str, Any] = {}
    exec(_function(t, t.good, k), namespace)  # our own template text, not model output
    return namespace[t.name]


def _bad(t: Template, k: int) -> Any:
    namespace: dict[str, Any] = {}
    exec(_function(t, t.bad, k), namespace)
    return namespace[t.name]


def _differs(good: Any, bad: Any, value: Any) -> bool:
    try:
        return bad(value) != good(value)
    except Exception:  # the bug raises on this input: it shows
        return True


def _test_file(t: Template, k: int, inputs: list[Any], tag: str) -> str:
    ref = _reference(t, k)
    lines = [f"from lib import {t.name}\n"]
    for i, value in enumerate(inputs):
        lines.append(f"\ndef test_{tag}_{i}():\n    arg, expected = {value!r}, {ref(value)!r}\n"
                     f"    got = {t.name}(arg)\n"
                     f'    assert got == expected, f"{t.name}({{arg!r}}) returned {{got!r}}, expected {{expected!r}}"\n')
    return "".join(lines)


def render_task(t: Template, k: int, rng: random.Random) -> GeneratedTask:
    """One task of template ``t`` with constant ``k``; the ideal completion writes the fixed lib.py."""
    good, bad = _reference(t, k), _bad(t, k)
    seen: set[str] = set()
    telling: list[Any] = []  # inputs on which the buggy function is wrong
    plain: list[Any] = []
    for _ in range(2000):
        value = _inputs(t.kind, rng, 1)[0]
        if repr(value) in seen:
            continue
        seen.add(repr(value))
        (telling if _differs(good, bad, value) else plain).append(value)
        if len(telling) >= 4 and len(telling) + len(plain) >= 9:
            break
    if len(telling) < 2:
        raise ValueError(f"template {t.name!r} (k={k}): the bug shows on too few inputs")
    rest = (telling[2:] + plain)[:7]
    visible, hidden = [telling[0], *rest[:2]], [telling[1], *rest[2:7]]
    files = {
        "README.md": f"# {t.name}\n\n`lib.{t.name}` should return {t.describe.format(k=k)}.\n",
        "lib.py": f'"""The library."""\nfrom helpers import describe  # noqa: F401\n\n\n{_function(t, t.bad, k)}',
        "helpers.py": f'def describe():\n    return "{t.describe.format(k=k)}"\n',
        "tests/test_lib.py": _test_file(t, k, visible, "visible"),
    }
    prompt = (f"The repository in /work has a failing test suite: lib.{t.name} should return "
              f"{t.describe.format(k=k)}. Use the tools to read the code, fix it, and run the tests.")
    spec = {"files": files, "hidden_tests": {"hidden/test_hidden.py": _test_file(t, k, hidden, "hidden")},
            "template": t.name, "k": k, "max_turns": 6, "timeout_s": 20}
    fixed_lib = _fixed_lib(t, k)
    ideal = "<tool_call>" + json.dumps({"name": "write_file", "arguments": {"path": "lib.py", "content": fixed_lib}}) \
        + "</tool_call>"
    return GeneratedTask(prompt=prompt, spec=spec, ideal=ideal)


def _fixed_lib(t: Template, k: int) -> str:
    return f'"""The library."""\nfrom helpers import describe  # noqa: F401\n\n\n{_function(t, t.good, k)}'


def make_repo(rng: random.Random, difficulty: float) -> GeneratedTask:
    """A generated repository task (difficulty widens the constants).

    The spec is compact (template, ``k``, seed): drawing stays cheap (held-out splits draw thousands) and the
    message small; :func:`expand_spec` writes the files out when the episode opens.
    """
    t = rng.choice(TEMPLATES)
    k = rng.randint(2, 5 if difficulty < 0.5 else 9)
    seed = rng.getrandbits(32)
    prompt = (f"The repository in /work has a failing test suite: lib.{t.name} should return "
              f"{t.describe.format(k=k)}. Use the tools to read the code, fix it, and run the tests.")
    ideal = "<tool_call>" + json.dumps({"name": "write_file", "arguments": {"path": "lib.py",
                                                                           "content": _fixed_lib(t, k)}}) + "</tool_call>"
    return GeneratedTask(prompt=prompt, spec={"template": t.name, "k": k, "seed": seed, "max_turns": 6,
                                              "timeout_s": 20}, ideal=ideal)


_BY_NAME = {t.name: t for t in TEMPLATES}


def expand_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with its ``files`` and ``hidden_tests`` (a compact generated spec is rendered from its seed)."""
    if "files" in spec:
        return spec
    t = _BY_NAME.get(str(spec.get("template")))
    if t is None:
        raise ValueError(f"repo spec: unknown template {spec.get('template')!r} and no 'files'")
    task = render_task(t, int(spec["k"]), random.Random(int(spec.get("seed", 0))))
    return {**task.spec, **{k: v for k, v in spec.items() if k in ("max_turns", "timeout_s")}}


def load_task_dir(path: str | Path) -> GeneratedTask:
    """A user-written task: ``repo/`` (the files), ``tests_visible/`` and ``tests_hidden/`` (``test_*.py``),
    ``task.toml`` (``prompt``, optional ``max_turns``, optional ``solution`` = a directory of fixed files).

    Raises ValueError naming the missing or bad part.
    """
    root = Path(path)
    meta_path = root / "task.toml"
    if not meta_path.is_file():
        raise ValueError(f"{root}: task.toml is missing")
    try:
        meta = tomllib.loads(meta_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{meta_path}: {exc}") from exc
    if not isinstance(meta.get("prompt"), str) or not meta["prompt"].strip():
        raise ValueError(f"{meta_path}: field 'prompt' (a non-empty string) is required")
    parts: dict[str, dict[str, str]] = {}
    for name in ("repo", "tests_visible", "tests_hidden"):
        folder = root / name
        if not folder.is_dir():
            raise ValueError(f"{root}: directory {name}/ is missing")
        parts[name] = {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}
    if not any(Path(n).name.startswith("test_") for n in parts["tests_hidden"]):
        raise ValueError(f"{root}/tests_hidden: no test_*.py file")
    files = {**parts["repo"], **{f"tests/{n}": c for n, c in parts["tests_visible"].items()}}
    spec = {"files": files, "hidden_tests": {f"hidden/{n}": c for n, c in parts["tests_hidden"].items()},
            "template": f"dir:{root.name}", "max_turns": int(meta.get("max_turns", 6)), "timeout_s": 20}
    ideal = ""
    if meta.get("solution"):
        sol = root / str(meta["solution"])
        if not sol.is_dir():
            raise ValueError(f"{meta_path}: solution directory {meta['solution']!r} does not exist")
        ideal = "".join("<tool_call>" + json.dumps({"name": "write_file", "arguments": {
            "path": str(p.relative_to(sol)), "content": p.read_text()}}) + "</tool_call>"
            for p in sorted(sol.rglob("*")) if p.is_file())
    return GeneratedTask(prompt=meta["prompt"].strip(), spec=spec, ideal=ideal)


def _summary(text: str) -> tuple[int, int]:
    m = _SUMMARY.search(text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


class RepoEpisode:
    """One repository episode in one sandbox: :meth:`open`, :meth:`step` per model reply, :meth:`finish`."""

    def __init__(self, spec: dict[str, Any], sandbox: Sandbox, *, limit_bytes: int = 4096) -> None:
        self.spec = spec = expand_spec(spec)
        self.sandbox = sandbox
        self.executor = ToolExecutor(sandbox, limit_bytes=limit_bytes, timeout_s=float(spec.get("timeout_s", 20)),
                                     tests_cmd=RUN_VISIBLE, tools=BUILTIN_TOOLS)
        self.turns = 0
        self.max_turns = int(spec.get("max_turns", 6))

    async def open(self) -> None:
        await self.sandbox.write_files(self.spec["files"])
        await self.sandbox.write_protected_files({"run_tests.py": RUNNER, **self.spec["hidden_tests"]})

    async def step(self, reply: str) -> list[dict[str, Any]]:
        """Execute the tool calls of one reply; the ``tool`` messages to hand back (a hint when there were none)."""
        self.turns += 1
        results = await self.executor.run_reply(reply)
        if not results:
            return [{"role": "user", "content": "No tool call found. Call a tool with "
                                                '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.'}]
        return [r.message() for r in results]

    async def finish(self) -> Facts:
        """Run the held-out tests; the facts the reward reads."""
        result = await self.sandbox.exec(RUN_HIDDEN, timeout=float(self.spec.get("timeout_s", 20)))
        passed, failed = _summary(result.stdout + result.stderr)
        return {"hidden_passed": passed, "hidden_total": passed + failed, "turns": self.turns,
                "tool_calls": self.executor.calls, "tool_errors": self.executor.errors,
                "completed": failed == 0 and passed > 0}


class RepoTerminalEpisode:
    """A :class:`RepoEpisode` with the interface the episode actor and the evaluation drive (``Episode``): the
    ``command`` of a step is the model's whole reply, the observation its ``tool`` messages (handed back to the
    model as the template's tool turns)."""

    def __init__(self, spec: dict[str, Any], pool_or_sandbox: Any) -> None:
        self.spec = spec
        self.source = pool_or_sandbox
        self.max_turns = int(spec.get("max_turns", 6))
        self._stack = contextlib.AsyncExitStack()
        self.episode: RepoEpisode | None = None
        self.last_result: ExecResult | None = None

    async def open(self) -> None:
        sandbox = await self._stack.enter_async_context(_hold(self.source))
        self.episode = RepoEpisode(self.spec, sandbox)
        await self.episode.open()

    @property
    def done(self) -> bool:
        return self.episode is not None and self.episode.turns >= self.max_turns

    async def step(self, command: str) -> list[dict[str, Any]]:
        if self.episode is None:
            raise RuntimeError("RepoTerminalEpisode.open() first")
        if self.done:
            self.last_result = None
            return [{"role": "user", "content": f"[episode over: max_turns={self.max_turns} reached]"}]
        messages = await self.episode.step(command)
        errors = sum(m["content"].startswith("[tool error]") for m in messages)
        self.last_result = ExecResult(exit_code=1 if errors else 0, stdout="", stderr="", timed_out=False,
                                      oom_killed=False, duration_s=0.0, truncated=False)
        return messages

    async def finish(self) -> Facts:
        if self.episode is None:
            raise RuntimeError("RepoTerminalEpisode.open() first")
        try:
            return await self.episode.finish()
        finally:
            await self._stack.aclose()

    async def abandon(self) -> None:
        await self._stack.aclose()


async def verify_repo(completion_text: str, spec: dict[str, Any], pool_or_sandbox: Any) -> Facts:
    """Single-text verification: every tool call in the completion runs in order, then the hidden tests."""
    async with _hold(pool_or_sandbox) as sandbox:
        episode = RepoEpisode(spec, sandbox)
        await episode.open()
        await episode.step(completion_text)
        return await episode.finish()


def repo_reward(facts: Facts, text: str) -> float:
    """Pass rate of the held-out tests."""
    total = int(facts.get("hidden_total", 0) or 0)
    return float(facts.get("hidden_passed", 0)) / total if total > 0 else 0.0


def repo_format(text: str) -> float:
    """1 when the reply contains at least one well-formed call of a declared tool."""
    from engine.tools import parse_tool_calls, validate_arguments
    calls = parse_tool_calls(text)
    return 1.0 if calls and all(not validate_arguments(c, BUILTIN_TOOLS) for c in calls) else 0.0


register_domain(Domain("repo", verify_repo, make_repo, repo_reward, repo_format, max_turns=6, stop=(),
                       max_new_tokens=512, episode="tools", episode_factory=RepoTerminalEpisode,
                       tools=tuple(BUILTIN_TOOLS), sandbox=True, tags=frozenset({"chat"}),
                       description="fix a small Python repository with tools; held-out tests judge it"))
