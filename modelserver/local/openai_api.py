"""OpenAI-compatible ``POST /v1/chat/completions`` over a :class:`LocalEngine` (its public submit API only).

Request: ``messages`` (system/user/assistant/tool; an assistant message may carry OpenAI ``tool_calls``, a
``tool`` message hands a result back), optional ``tools`` (function JSON schemas), all rendered by
:func:`engine.tools.render_tool_messages` as training and evaluation render them: the chat template's own
tool support, else a Hermes-style system block and the calls as ``<tool_call>`` text), ``temperature``, ``top_p``, ``max_tokens`` (or ``max_completion_tokens``), ``stop``, ``n``, ``seed``,
``stream``. Response: ``chat.completion`` with one choice per sample; when a reply holds tool calls (any
format :func:`engine.tools.parse_tool_calls` reads) the message carries ``tool_calls`` (arguments as a JSON
string, as OpenAI does) and ``finish_reason`` is ``"tool_calls"``. ``stream: true`` answers Server-Sent
Events: ``chat.completion.chunk`` objects with content deltas, a last chunk per choice with its
``finish_reason`` (and ``tool_calls``, sent whole once the reply is complete), then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from collections.abc import Callable
from typing import Any

from aiohttp import web

from modelserver.local.engine import LocalEngine, Sequence
from modelserver.local.protocol import BadRequest, ProtocolError, parse_sampling_params
from engine.tools import parse_tool_calls, render_tool_messages

__all__ = ["add_openai_routes"]

EngineOf = Callable[[web.Request], LocalEngine | None]
_ROLES = {"system", "user", "assistant", "tool"}


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": param}},
                             status=status)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list is required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}].role: must be one of {sorted(_ROLES)}")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: must be a string")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) and c["function"]["name"] for c in calls)):
            raise BadRequest(f"messages[{i}].tool_calls: only on an assistant message, a list of "
                             '{"type": "function", "function": {"name", "arguments"}}')
        out.append({**m, "content": content})
    return out


def _sampling(body: dict[str, Any], vocab_size: int) -> Any:
    raw: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("n", "n"),
                         ("sampling_seed", "seed")):
        if body.get(theirs) is not None:
            raw[ours] = body[theirs]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        raw["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        raw["stop"] = [stop] if isinstance(stop, str) else stop
    return parse_sampling_params(raw, vocab_size=vocab_size)


def _tool_calls(text: str) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in parse_tool_calls(text) if not c.error]


def _finish(seq: Sequence, calls: list[dict[str, Any]]) -> str:
    if calls:
        return "tool_calls"
    kind = (seq.finish_reason or {}).get("type")
    return "length" if kind == "length" else "stop"


async def handle_chat_completions(request: web.Request, engine_of: EngineOf, model_name: str) -> web.StreamResponse:
    engine = engine_of(request)
    if engine is None:
        return _error(503, "the model is still loading")
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    try:
        messages = _messages(body)
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")
                for t in tools)):
            raise BadRequest("tools: a list of {\"type\": \"function\", \"function\": {\"name\", ...}}")
        params = _sampling(body, engine.vocab_size)
        text = render_tool_messages(engine.tokenizer, messages, tools) if getattr(
            engine.tokenizer, "chat_template", None) else "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        prompt = list(engine.tokenizer.encode(text, add_special_tokens=False))
        if not prompt:
            raise BadRequest("messages: the conversation renders to zero tokens")
        seqs = [engine.submit(prompt, replace(params, n=1, sampling_seed=None if params.sampling_seed is None
                                              else params.sampling_seed + j)) for j in range(params.n)]
    except ProtocolError as exc:
        return _error(400, str(exc))
    except (TypeError, ValueError) as exc:  # a template that cannot render these messages
        return _error(400, f"messages: {exc}")
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.get("stream"):
        try:
            return await _stream(request, engine, seqs, cid, created, model_name)
        finally:
            engine.abort_unfinished(seqs)
    await engine.wait_finished(seqs)
    choices = []
    for i, seq in enumerate(seqs):
        out = engine.output_text(seq)
        calls = _tool_calls(out)
        message: dict[str, Any] = {"role": "assistant", "content": out}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": i, "message": message, "finish_reason": _finish(seq, calls)})
    usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(s.output_ids) for s in seqs)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return web.json_response({"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                              "choices": choices, "usage": usage})


async def _stream(request: web.Request, engine: LocalEngine, seqs: list[Sequence], cid: str, created: int,
                  model_name: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(choice: dict[str, Any]) -> None:
        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                 "choices": [choice]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    for i, seq in enumerate(seqs):  # samples are generated concurrently; sent one after the other
        await send({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        sent = ""
        while True:
            done = seq.finished
            text = engine.output_text(seq)
            if text.startswith(sent) and len(text) > len(sent):
                await send({"index": i, "delta": {"content": text[len(sent):]}, "finish_reason": None})
                sent = text
            if done:
                break
            await seq.wait_changed()
        calls = _tool_calls(sent)
        delta: dict[str, Any] = {"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]} if calls else {}
        await send({"index": i, "delta": delta, "finish_reason": _finish(seq, calls)})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def add_openai_routes(app: web.Application, engine_of: EngineOf, model_name: str = "local") -> None:
    """Mount ``POST /v1/chat/completions`` on ``app``; ``engine_of`` gives the ready engine (None: loading)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await handle_chat_completions(request, engine_of, model_name)

    app.router.add_post("/v1/chat/completions", handler)
