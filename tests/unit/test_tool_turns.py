"""Tools declared through the chat template and tool results handed back in the ``tool`` role.

- the wire fields: ``Task.tools`` and ``SandboxResult.messages`` round-trip, are left out of the body while
  empty (a consumer that predates them still reads those records) and a bad tool names its field;
- the scheduler fills ``Task.tools`` from the task's domain (a JSONL row may bring its own);
- :func:`observation_ids`, the one rendering of a step's observation (inference actor and evaluation):
  tool messages whole as tool turns, shell text cut to its last 400 characters as a user turn;
- :func:`render_tool_messages` with SmolLM2's real template (ignores tools: Hermes block, calls as text) and
  with small templates that render tools and ``tool_calls`` natively, or reject the ``tool`` role.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from transformers import AutoTokenizer

from domains import DOMAINS
from actors.inference.actor import OBSERVATION_LIMIT, format_observation, observation_ids, observation_text
from modelserver.llm import build_char_tokenizer, render_observation, render_prompt
from actors.runtime import Runtime
from actors.scheduler import GeneratorSource, SchedulerActor, TaskFileSource
from engine.tasks import TaskFileError
from engine.tools import BUILTIN_TOOLS, parse_tool_calls, render_tool_messages
from engine.config import EngineConfig
from engine.schemas import SandboxResult, SchemaError, Task
from streams.codec import decode, encode
from streams.memory import MemoryEventLog

RESULTS = [{"role": "tool", "name": "run_tests", "content": "FAILED test_lib.py::test_0\n" + "x" * 3000 + "\nSUMMARY"},
           {"role": "tool", "name": "read_file", "content": "def f(x):\n    return x - 1\n"}]


@pytest.fixture(scope="module")
def smol(real_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(real_model_dir), local_files_only=True)


# -- the wire --------------------------------------------------------------------------------------------

def test_task_tools_round_trip_and_are_left_out_while_empty() -> None:
    task = Task(task_id="t", domain="repo", prompt="fix it", spec={}, tools=list(BUILTIN_TOOLS))
    value, _ = encode(task, producer="test")
    assert decode(value).message == task
    plain, _ = encode(Task(task_id="t", domain="arith", prompt="1+1=", spec={}), producer="test")
    assert "tools" not in msgpack.unpackb(plain, raw=False)["body"]  # an older consumer still reads it
    older = Task.from_body({"task_id": "t", "domain": "arith", "prompt": "p", "spec": {}})  # an older producer's
    assert isinstance(older, Task) and older.tools == []
    with pytest.raises(SchemaError, match=r"task\.tools\[1\]\.function\.name"):
        Task(task_id="t", domain="repo", prompt="p", spec={}, tools=[BUILTIN_TOOLS[0], {"type": "function"}]).validate()
    with pytest.raises(SchemaError, match=r"task\.tools\[0\]"):
        Task.from_body({"task_id": "t", "domain": "repo", "prompt": "p", "spec": {}, "tools": ["bash"]})


def test_sandbox_result_messages_round_trip_and_are_left_out_while_empty() -> None:
    result = SandboxResult(episode_id="e", step=1, observation=observation_text(RESULTS), messages=RESULTS)
    value, _ = encode(result, producer="test")
    assert decode(value).message == result
    shell, _ = encode(SandboxResult(episode_id="e", step=1, observation="ok"), producer="test")
    assert "messages" not in msgpack.unpackb(shell, raw=False)["body"]


# -- the scheduler ---------------------------------------------------------------------------------------

def test_sources_and_the_scheduler_carry_the_domains_tools(tmp_path: Path) -> None:
    assert GeneratorSource(DOMAINS["repo"]).next(0.0).tools == tuple(BUILTIN_TOOLS)
    assert GeneratorSource(DOMAINS["arith"]).next(0.0).tools == ()
    rt = Runtime(EngineConfig(), event_log=MemoryEventLog(), use_nats=False)  # nothing is connected
    scheduler = SchedulerActor(rt, sources=[GeneratorSource(DOMAINS["repo"])])
    task = scheduler._next_task()
    assert task is not None and task.tools == list(BUILTIN_TOOLS) and task.max_turns > 1
    task.validate()

    own = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    path = tmp_path / "tasks.jsonl"
    rows = [{"domain": "repo", "prompt": "p", "answer": "x"},
            {"domain": "repo", "prompt": "p", "answer": "x", "tools": own},
            {"domain": "arith", "prompt": "1+1=", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = TaskFileSource(path)
    assert [source.next(0.0).tools for _ in range(3)] == [tuple(BUILTIN_TOOLS), tuple(own), ()]  # type: ignore[union-attr]
    rows.append({"domain": "repo", "prompt": "p", "answer": "x", "tools": [{"function": {}}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TaskFileError, match=r"tasks\.jsonl:4: field 'tools': expected a list of"):
        TaskFileSource(path)


# -- one rendering of a step's observation -----------------------------------------------------------------

def test_tool_messages_come_back_whole_as_tool_turns(smol: Any) -> None:
    eos = smol.eos_token_id
    ids = observation_ids(smol, RESULTS, eos)
    text = smol.decode(ids)
    # the model's own <|im_end|> ended its turn: only the newline after it, then the two tool turns, whole
    assert text == ("\n<|im_start|>tool\n" + RESULTS[0]["content"] + "<|im_end|>\n<|im_start|>tool\n"
                    + RESULTS[1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert ids == render_observation(smol, RESULTS, ended_turn=True)
    # a reply cut by the token budget is closed by the template's own end-of-turn first
    assert smol.decode(observation_ids(smol, RESULTS, 42)).startswith("<|im_end|>\n<|im_start|>tool\n")


def test_shell_text_keeps_its_user_turn_and_cut(smol: Any) -> None:
    output = "".join(f"line {i}\n" for i in range(200))
    text = smol.decode(observation_ids(smol, output, smol.eos_token_id))
    assert text.startswith("\n<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "line 199\n$ " in text and "line 0\n" not in text
    assert text.count("line") == format_observation(output).count("line") < 200
    assert len(format_observation(output)) <= OBSERVATION_LIMIT + 2


def test_without_a_chat_template_the_observation_is_text_after_a_newline() -> None:
    char = build_char_tokenizer()
    newline = int(char.convert_tokens_to_ids("\n"))  # type: ignore[arg-type]
    assert char.decode(observation_ids(char, "ok", newline)) == "ok\n$ "
    assert char.decode(observation_ids(char, RESULTS[1:], None)) == "\n" + RESULTS[1]["content"] + "$ "


# -- declaring tools and rendering calls -------------------------------------------------------------------

def test_smollm2_gets_the_hermes_block_and_assistant_calls_as_text(smol: Any) -> None:
    prompt = smol.decode(render_prompt(smol, "fix it", tools=BUILTIN_TOOLS))
    assert "<tools>" in prompt and '"name": "write_file"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "lib.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "run_tests", "content": "SUMMARY passed=0 failed=1"},
        {"role": "tool", "tool_call_id": "c2", "name": "read_file", "content": "def f(x): ..."}]
    text = render_tool_messages(smol, [{**m, "content": m["content"] or ""} for m in conversation], BUILTIN_TOOLS)
    turn = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    calls = parse_tool_calls(turn)  # what the model is asked to write, read back as the model's would be
    assert [(c.name, c.arguments) for c in calls] == [("run_tests", {}), ("read_file", {"path": "lib.py"})]
    assert "<|im_start|>tool\nSUMMARY passed=0 failed=1<|im_end|>\n<|im_start|>tool\ndef f(x): ...<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and text.count("# Tools") == 1


NATIVE = ("{%- if tools %}[TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}]"
          "{% endif %}"
          "{%- for m in messages %}"
          "{%- if m.role == 'tool' %}"
          "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|user|>{% endif %}"
          "<r>{{ m.content }}</r>"
          "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}</s>{% endif %}"
          "{%- elif m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
          "{%- for c in m.tool_calls %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}"
          "</s>"
          "{%- else %}<|{{ m.role }}|>{{ m.content }}</s>{% endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}")
STRICT = ("{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
          "<|{{ m.role }}|>{{ m.content }}</s>{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}")


def _templated(template: str) -> Any:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def test_a_template_with_tool_support_renders_tools_calls_and_grouped_results_itself() -> None:
    tokenizer = _templated(NATIVE)
    prompt = tokenizer.decode(render_prompt(tokenizer, "fix it", tools=BUILTIN_TOOLS))
    assert prompt == "[TOOLS bash,read_file,write_file,run_tests]<|user|>fix it</s><|assistant|>"  # no Hermes block
    text = render_tool_messages(tokenizer, [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]}], BUILTIN_TOOLS)
    assert '<call>read_file {"path": "a.py"}</call>' in text  # arguments as an object, not a JSON string
    # consecutive tool results rendered together: the template groups them into one turn
    ids = observation_ids(tokenizer, RESULTS, tokenizer.eos_token_id)
    assert tokenizer.decode(ids) == (f"<|user|><r>{RESULTS[0]['content']}</r><r>{RESULTS[1]['content']}</r>"
                                     "</s><|assistant|>")


def test_a_template_that_rejects_the_tool_role_gets_results_as_user_turns() -> None:
    tokenizer = _templated(STRICT)
    text = tokenizer.decode(observation_ids(tokenizer, RESULTS[1:], tokenizer.eos_token_id))
    assert text == f"<|user|>{RESULTS[1]['content']}</s><|assistant|>"
    with pytest.raises(Exception, match="roles must be"):  # no tool message to blame: the template's error stands
        render_tool_messages(tokenizer, [{"role": "robot", "content": "x"}], None)


def test_a_generated_repo_task_renders_with_its_tools(smol: Any) -> None:
    prompt, spec = DOMAINS["repo"].generate(random.Random(0))
    ids = render_prompt(smol, prompt, tools=list(DOMAINS["repo"].tools))
    assert '"name": "run_tests"' in smol.decode(ids) and prompt in smol.decode(ids)
