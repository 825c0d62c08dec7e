"""Executes parsed tool calls in an episode's sandbox and formats the results as ``tool`` messages.

Every outcome is a message, never an exception the episode has to catch: a malformed or unknown call, bad
arguments, a missing file or a command that times out each come back as text the model can read and act
on. Results longer than ``limit_bytes`` keep their head and tail around an explicit marker
``[... truncated N bytes ...]`` (the end of a test report is usually where the failure summary is).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.tools import BUILTIN_TOOLS, ToolCall, parse_tool_calls, validate_arguments
from sandboxes.base import Sandbox, SandboxError

__all__ = ["DEFAULT_LIMIT_BYTES", "RUN_TESTS_CMD", "ToolExecutor", "ToolResult", "truncate"]

DEFAULT_LIMIT_BYTES = 4096
RUN_TESTS_CMD = "python3 -m pytest -q -p no:cacheprovider tests 2>&1"
"""What ``run_tests`` runs in /work (the visible tests live in /work/tests)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolResult:
    """One call's outcome: the ``tool`` message content and whether it was an error."""

    name: str
    content: str
    error: bool

    def message(self) -> dict[str, Any]:
        """The chat message handing the result back (the Hugging Face / OpenAI ``tool`` role)."""
        return {"role": "tool", "name": self.name or "error", "content": self.content}


def truncate(text: str, limit_bytes: int) -> str:
    """``text`` if it fits in ``limit_bytes`` (UTF-8), else its head and tail around a truncation marker."""
    data = text.encode()
    if len(data) <= limit_bytes:
        return text
    half = max(limit_bytes // 2, 1)
    dropped = len(data) - 2 * half
    head = data[:half].decode(errors="ignore")
    tail = data[-half:].decode(errors="ignore")
    return f"{head}\n[... truncated {dropped} bytes ...]\n{tail}"


class ToolExecutor:
    """Runs ``bash``/``read_file``/``write_file``/``run_tests`` calls in one sandbox."""

    def __init__(self, sandbox: Sandbox, *, limit_bytes: int = DEFAULT_LIMIT_BYTES, timeout_s: float = 20.0,
                 tests_cmd: str = RUN_TESTS_CMD, tools: list[dict[str, Any]] | None = None) -> None:
        if limit_bytes < 64:
            raise ValueError(f"limit_bytes must be at least 64, got {limit_bytes}")
        self.sandbox = sandbox
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s
        self.tests_cmd = tests_cmd
        self.tools = tools if tools is not None else BUILTIN_TOOLS
        self.calls = self.errors = 0

    async def run_reply(self, text: str) -> list[ToolResult]:
        """Execute every tool call in one model reply (none: an empty list)."""
        return [await self.execute(call) for call in parse_tool_calls(text)]

    async def execute(self, call: ToolCall) -> ToolResult:
        self.calls += 1
        problem = validate_arguments(call, self.tools)
        if problem:
            self.errors += 1
            return ToolResult(call.name, f"[tool error] {problem}", True)
        try:
            content, failed = await self._dispatch(call)
        except (ValueError, OSError, SandboxError, UnicodeDecodeError) as exc:
            content, failed = f"[tool error] {call.name}: {type(exc).__name__}: {exc}", True
        self.errors += failed
        return ToolResult(call.name, truncate(content, self.limit_bytes), failed)

    async def _shell(self, command: str) -> tuple[str, bool]:
        result = await self.sandbox.exec(command, timeout=self.timeout_s)
        text = result.stdout + result.stderr
        if result.timed_out:
            text += f"\n[command timed out after {self.timeout_s:g}s]"
        return f"{text}\n[exit code {result.exit_code}]", False

    async def _dispatch(self, call: ToolCall) -> tuple[str, bool]:
        args = call.arguments
        if call.name == "bash":
            return await self._shell(args["command"])
        if call.name == "run_tests":
            return await self._shell(self.tests_cmd)
        if call.name == "read_file":
            try:
                return (await self.sandbox.read_file(args["path"])).decode("utf-8", errors="replace"), False
            except (FileNotFoundError, SandboxError) as exc:
                return f"[tool error] read_file: no such file {args['path']!r} ({exc})", True
        if call.name == "write_file":
            await self.sandbox.write_files({args["path"]: args["content"]})
            return f"wrote {len(args['content'].encode())} bytes to {args['path']}", False
        return f"[tool error] tool {call.name!r} is declared but has no executor", True
