"""Tool declarations, their rendering into a prompt, and the parsing of a model's tool calls.

Tools are declared in the OpenAI / Hugging Face form (``{"type": "function", "function": {"name",
"description", "parameters": <JSON schema>}}``), the form ``tokenizer.apply_chat_template(..., tools=...)``
takes. A chat template that ignores ``tools`` (SmolLM2-135M-Instruct's does) would silently drop them, so
:func:`render_tool_messages` detects that and prepends a Hermes/Qwen-style system block instead::

    # Tools
    You may call one or more functions ...
    <tools>
    {"type": "function", "function": {...}}
    </tools>
    ... <tool_call>{"name": <name>, "arguments": <args>}</tool_call>

Parsing (:func:`parse_tool_calls`) accepts the three forms instruct models emit:

- Hermes/Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several allowed);
- Llama 3 JSON: the whole reply is ``{"name": ..., "parameters": {...}}`` (``arguments`` also accepted);
- Llama 3 ``<|python_tag|>`` followed by such JSON (or ``name.call(k=v)`` is not supported: reported as an error).

A malformed call never raises: it comes back as a :class:`ToolCall` with ``error`` set, which the executor
turns into a tool error message for the model to read.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

__all__ = ["BUILTIN_TOOLS", "ToolCall", "apply_chat_template", "hermes_call", "parse_tool_calls",
           "render_tool_messages", "template_declares_tools", "tool_block", "tool_names", "validate_arguments"]

BUILTIN_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command in the repository directory; returns its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write (replace) a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the repository's visible test suite; returns the report.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
]
"""The tools of a repository episode (executed by :mod:`domains.tool_exec`)."""

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
PYTHON_TAG = "<|python_tag|>"
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made; ``error`` (a sentence for the model) when it could not be understood."""

    name: str
    arguments: dict[str, Any]
    error: str = ""
    raw: str = ""


def is_function_tool(tool: Any) -> bool:
    """Whether ``tool`` is a declared function: ``{"function": {"name": <non-empty string>, ...}, ...}``."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"])


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def tool_block(tools: list[dict[str, Any]]) -> str:
    """The Hermes/Qwen system-prompt tool block, for templates that ignore ``tools``."""
    lines = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else json.dumps(template) if template else ""


def _arguments(raw: Any) -> Any:
    """A call's arguments as a JSON object (OpenAI sends them as a JSON string)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw


def hermes_call(name: str, arguments: Any) -> str:
    """One call in the Hermes/Qwen text form the :func:`tool_block` asks for (and :func:`parse_tool_calls` reads)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _prepare(messages: list[dict[str, Any]], native_calls: bool) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` (OpenAI form) for the template: kept, arguments as objects, for a template that
    renders them; else written into the message's text as Hermes ``<tool_call>`` blocks (what the model emits)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or not calls:
            out.append(m)
            continue
        fns = [c.get("function", c) for c in calls]
        if native_calls:
            out.append({**m, "content": m.get("content") or "", "tool_calls": [
                {**c, "function": {**fn, "arguments": _arguments(fn.get("arguments", {}))}}
                for c, fn in zip(calls, fns)]})
            continue
        text = "\n".join(hermes_call(str(fn.get("name", "")), _arguments(fn.get("arguments", {}))) for fn in fns)
        rest = {k: v for k, v in m.items() if k != "tool_calls"}
        out.append({**rest, "content": f"{m.get('content') or ''}\n{text}".lstrip("\n")})
    return out


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)``; a template that rejects the ``tool``
    role (it raises on it) gets those messages as ``user`` turns instead."""
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))
    except Exception:  # jinja2's TemplateError (raise_exception) or a template's own KeyError/TypeError
        if not any(m.get("role") == "tool" for m in messages):
            raise
    as_user = [{"role": "user", "content": m.get("content") or ""} if m.get("role") == "tool" else m for m in messages]
    return str(tokenizer.apply_chat_template(as_user, tokenize=False, **kwargs))


def template_declares_tools(tokenizer: Any, tools: list[dict[str, Any]]) -> bool:
    """Whether the chat template renders ``tools=`` itself (else :func:`render_tool_messages` adds a block)."""
    probe = [{"role": "user", "content": "x"}]
    return apply_chat_template(tokenizer, probe, tools=tools) != apply_chat_template(tokenizer, probe)


def render_tool_messages(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         *, add_generation_prompt: bool = True) -> str:
    """The chat template's text of ``messages`` with ``tools`` declared.

    Uses the template's own ``tools`` support when rendering with tools changes the text; otherwise (the
    template ignores them) the :func:`tool_block` is merged into the system message (or added as one).
    ``tool`` role messages are passed through; a template that rejects the role gets them as user turns.
    Assistant messages with OpenAI ``tool_calls`` are passed to a template that renders ``tool_calls``
    (arguments as objects); for one that does not, the calls are written into the message's text as Hermes
    ``<tool_call>`` blocks, the form the tool block asks the model for.
    """
    native = bool(tools) and template_declares_tools(tokenizer, tools or [])
    messages = _prepare(messages, native or "tool_calls" in _template_source(tokenizer))
    if not tools:
        return apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    if native:
        return apply_chat_template(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    block = tool_block(tools)
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{block}".lstrip()}
        merged = [first, *messages[1:]]
    else:
        merged = [{"role": "system", "content": block}, *messages]
    return apply_chat_template(tokenizer, merged, add_generation_prompt=add_generation_prompt)


def _call_from_json(text: str) -> ToolCall:
    raw = text.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"invalid JSON in tool call: {exc.msg} at column {exc.colno}", raw)
    if not isinstance(obj, dict):
        return ToolCall("", {}, f"a tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, 'a tool call needs a "name" string', raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, {}, f"invalid JSON in the arguments of {name!r}: {exc.msg}", raw)
    if not isinstance(args, dict):
        return ToolCall(name, {}, f'the "arguments" of {name!r} must be a JSON object', raw)
    return ToolCall(name, args, "", raw)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in one model reply (empty when it made none; plain prose is no call)."""
    if "<tool_call>" in text:
        return [_call_from_json(m.group(1)) for m in _TOOL_CALL_RE.finditer(text)]
    if PYTHON_TAG in text:
        body = text.split(PYTHON_TAG, 1)[1].replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
        return [_call_from_json(part) for part in body.split(";") if part.strip()] or [
            ToolCall("", {}, "empty call after <|python_tag|>", body)]
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}") and '"name"' in stripped:
        return [_call_from_json(stripped)]
    return []


def validate_arguments(call: ToolCall, tools: list[dict[str, Any]]) -> str:
    """An error sentence when ``call`` names no declared tool or its arguments break the schema; else ''."""
    if call.error:
        return call.error
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    fn = by_name.get(call.name)
    if fn is None:
        return f"unknown tool {call.name!r}; available: {', '.join(sorted(by_name))}"
    schema = fn.get("parameters") or {}
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in call.arguments]
    if missing:
        return f"tool {call.name!r}: missing argument(s) {', '.join(missing)}"
    for key, value in call.arguments.items():
        if key not in props:
            return f"tool {call.name!r}: unexpected argument {key!r}"
        want = _JSON_TYPES.get(props[key].get("type", ""))
        if want is not None and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
            return f"tool {call.name!r}: argument {key!r} must be a {props[key]['type']}"
    return ""
