"""``POST /v1/chat/completions`` on a real ``rollout inference serve`` subprocess serving SmolLM2-135M-Instruct.

Real HTTP on loopback: a request declaring tools (non-streaming and ``stream: true``), ``n``, ``stop`` and
bad requests. SmolLM2's chat template ignores ``tools``, so the server injects the Hermes-style tool block;
the test shows the tools reached the prompt (more prompt tokens). The untrained 135M model seldom emits a
call, so any ``tool_calls`` it does return are checked for shape; parsing is covered by tests/unit/test_tools.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.tools import BUILTIN_TOOLS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0


def _post(url: str, body: Any) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


@pytest.fixture(scope="module")
def server_url(real_model_dir: Path) -> Iterator[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "inference", "serve", "--port", "0", "--model-dir",
                             str(real_model_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "server exited before listening"
        url = json.loads(line)["url"]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # poll readiness with a deadline
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=60) as resp:
                    if resp.status == 200:
                        break
            except urllib.error.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server not ready"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


MESSAGES = [{"role": "system", "content": "You fix Python repositories."},
            {"role": "user", "content": "The tests fail. Call run_tests."}]


def test_chat_completion_with_tools(server_url: str) -> None:
    status, raw = _post(server_url + "/v1/chat/completions",
                        {"messages": MESSAGES, "tools": BUILTIN_TOOLS, "temperature": 0, "max_tokens": 24, "n": 2})
    assert status == 200, raw
    body = json.loads(raw)
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
        for call in choice["message"].get("tool_calls", []):
            assert call["type"] == "function" and isinstance(json.loads(call["function"]["arguments"]), dict)
    assert body["choices"][0]["message"]["content"] == body["choices"][1]["message"]["content"]  # greedy
    # The tools reached the prompt: declaring them changes the rendered conversation, hence the usage.
    status, raw = _post(server_url + "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens"] < body["usage"]["prompt_tokens"]


CALLED: list[dict[str, Any]] = [
    *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "run_tests",
     "content": "FAILED test_lib.py::test_visible_0: AssertionError\nSUMMARY passed=2 failed=1"}]


def test_a_conversation_with_tool_calls_and_results_renders_as_training_renders_it(
        server_url: str, real_model_dir: Path) -> None:
    """Assistant ``tool_calls`` and a ``tool`` result go through the same rendering as training and evaluation
    (``render_tool_messages``): the prompt the server ran is exactly that many tokens, the result's tool turn
    is in it (dropping it or the call shortens the prompt)."""
    from transformers import AutoTokenizer

    from engine.tools import render_tool_messages

    tokenizer = AutoTokenizer.from_pretrained(str(real_model_dir), local_files_only=True)
    status, raw = _post(server_url + "/v1/chat/completions",
                        {"messages": CALLED, "tools": BUILTIN_TOOLS, "temperature": 0, "max_tokens": 8})
    assert status == 200, raw
    prompt_tokens = json.loads(raw)["usage"]["prompt_tokens"]
    text = render_tool_messages(tokenizer, [{**m, "content": m["content"] or ""} for m in CALLED], BUILTIN_TOOLS)
    assert prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>' in text  # SmolLM2: the call as text
    assert "<|im_start|>tool\nFAILED test_lib.py" in text
    for fewer in (CALLED[:-1], [*CALLED[:2], CALLED[3]]):
        _, raw = _post(server_url + "/v1/chat/completions",
                       {"messages": fewer, "tools": BUILTIN_TOOLS, "temperature": 0, "max_tokens": 1})
        assert json.loads(raw)["usage"]["prompt_tokens"] < prompt_tokens


def test_streaming_ends_with_done_and_matches_the_plain_reply(server_url: str) -> None:
    request = {"messages": MESSAGES, "tools": BUILTIN_TOOLS, "temperature": 0, "max_tokens": 16}
    _, raw = _post(server_url + "/v1/chat/completions", request)
    plain = json.loads(raw)["choices"][0]
    status, raw = _post(server_url + "/v1/chat/completions", {**request, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["finish_reason"]


def test_stop_string_cuts_the_reply(server_url: str) -> None:
    request = {"messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    full = json.loads(_post(server_url + "/v1/chat/completions", request)[1])["choices"][0]["message"]["content"]
    stop = full.strip().split()[1] if len(full.strip().split()) > 1 else full.strip()[:2]
    cut = json.loads(_post(server_url + "/v1/chat/completions", {**request, "stop": [stop]})[1])
    assert stop not in cut["choices"][0]["message"]["content"]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, fragment", [
    (b"not json", "not JSON"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
     "messages[2].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature"),
])
def test_bad_requests_name_the_field(server_url: str, body: Any, fragment: str) -> None:
    status, raw = _post(server_url + "/v1/chat/completions", body)
    assert status == 400 and fragment in json.loads(raw)["error"]["message"]
