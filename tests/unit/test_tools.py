"""Tool-call parsing over every supported format and malformed input; argument validation; truncation."""

from __future__ import annotations

import json

import pytest

from domains.tool_exec import truncate
from engine.tools import BUILTIN_TOOLS, PYTHON_TAG, ToolCall, parse_tool_calls, tool_block, validate_arguments


def test_hermes_single_and_multiple_calls() -> None:
    text = ('I will look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "lib.py"}}\n</tool_call>'
            '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("read_file", {"path": "lib.py"}, ""), ("run_tests", {}, "")]


def test_hermes_unclosed_tag_at_end_of_generation_still_parses() -> None:
    calls = parse_tool_calls('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}')
    assert calls[0].name == "bash" and calls[0].arguments == {"command": "ls"} and not calls[0].error


def test_openai_style_string_arguments() -> None:
    calls = parse_tool_calls('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>')
    assert calls[0].arguments == {"command": "pwd"}


def test_llama3_bare_json_with_parameters() -> None:
    calls = parse_tool_calls(' {"name": "write_file", "parameters": {"path": "a.py", "content": "x = 1\\n"}} ')
    assert calls == [ToolCall("write_file", {"path": "a.py", "content": "x = 1\n"}, "", calls[0].raw)]


def test_llama3_python_tag_with_eom_and_several_calls() -> None:
    text = (PYTHON_TAG + '{"name": "bash", "parameters": {"command": "ls"}}; '
            '{"name": "run_tests", "parameters": {}}<|eom_id|>')
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)] == [("bash", {"command": "ls"}), ("run_tests", {})]


def test_prose_is_no_call() -> None:
    assert parse_tool_calls("The answer is {probably} 4.") == []
    assert parse_tool_calls("") == []


@pytest.mark.parametrize("text, fragment", [
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', "invalid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', '"arguments"'),
    ('<tool_call>{"name": "bash", "arguments": "{nope"}</tool_call>', "invalid JSON in the arguments"),
    (PYTHON_TAG + "   ", "empty call"),
    (PYTHON_TAG + "bash.call(command='ls')", "invalid JSON"),
])
def test_malformed_calls_become_errors_not_exceptions(text: str, fragment: str) -> None:
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and fragment in calls[0].error
    assert validate_arguments(calls[0], BUILTIN_TOOLS) == calls[0].error


@pytest.mark.parametrize("call, fragment", [
    (ToolCall("rm_everything", {}), "unknown tool 'rm_everything'"),
    (ToolCall("bash", {}), "missing argument(s) command"),
    (ToolCall("bash", {"command": 3}), "argument 'command' must be a string"),
    (ToolCall("bash", {"command": True}), "must be a string"),
    (ToolCall("read_file", {"path": "a", "mode": "r"}), "unexpected argument 'mode'"),
])
def test_bad_arguments_are_named(call: ToolCall, fragment: str) -> None:
    assert fragment in validate_arguments(call, BUILTIN_TOOLS)


def test_valid_call_passes_validation() -> None:
    assert validate_arguments(ToolCall("write_file", {"path": "a", "content": ""}), BUILTIN_TOOLS) == ""


def test_tool_block_lists_every_tool_as_json() -> None:
    block = tool_block(BUILTIN_TOOLS)
    inner = block.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line)["function"]["name"] for line in inner.splitlines()] == [
        "bash", "read_file", "write_file", "run_tests"]


def test_truncate_keeps_head_and_tail_and_names_the_dropped_bytes() -> None:
    text = "A" * 100 + "B" * 1000 + "Z" * 100
    out = truncate(text, 200)
    assert out.startswith("A" * 100) and out.endswith("Z" * 100)
    assert "[... truncated 1000 bytes ...]" in out
    assert truncate("short", 200) == "short"


def test_render_prompt_declares_tools_and_observation_uses_tool_role(real_model_dir) -> None:
    """SmolLM2's template ignores ``tools``: the Hermes block goes into the system turn instead."""
    from transformers import AutoTokenizer

    from modelserver.llm import render_observation, render_prompt
    tokenizer = AutoTokenizer.from_pretrained(str(real_model_dir), local_files_only=True)
    with_tools = tokenizer.decode(render_prompt(tokenizer, "fix it", system="You fix code.", tools=BUILTIN_TOOLS))
    without = tokenizer.decode(render_prompt(tokenizer, "fix it", system="You fix code."))
    assert "<tools>" in with_tools and '"name": "run_tests"' in with_tools and "<tools>" not in without
    assert with_tools.index("You fix code.") < with_tools.index("<tools>") < with_tools.index("fix it")
    observation = tokenizer.decode(render_observation(tokenizer, "SUMMARY passed=1", ended_turn=True, role="tool"))
    assert "<|im_start|>tool\nSUMMARY passed=1" in observation
