"""The repo domain and the tool executor on the real bwrap sandbox.

- every template: the initial repository fails its hidden tests and the reference solution passes them
  (batched: one sandbox per batch of templates, reset between tasks);
- a multi-turn episode driven by a SCRIPTED policy (not a model: a function that reacts to the observation
  text), whose second attempt follows the test failure it read from a ``run_tests`` tool result; the
  sandbox, the tool executor and the hidden-test verifier are real;
- malformed calls and oversized output come back as tool messages, the episode goes on.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from domains.repo import TEMPLATES, RepoEpisode, load_task_dir, render_task, repo_reward, verify_repo
from domains import DOMAINS
from sandboxes import Limits, open_sandbox

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BATCH = 8
BATCHES = [TEMPLATES[i:i + BATCH] for i in range(0, len(TEMPLATES), BATCH)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _call(name: str, **arguments: object) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_there_are_at_least_30_templates() -> None:
    assert len({t.name for t in TEMPLATES}) >= 30


@pytest.mark.anyio
@pytest.mark.parametrize("batch", BATCHES, ids=[f"{b[0].name}..{b[-1].name}" for b in BATCHES])
async def test_reference_passes_hidden_tests_and_initial_repo_fails(batch: tuple) -> None:
    async with open_sandbox("bwrap", Limits(memory_mb=256, pids=64, timeout_s=20)) as sandbox:
        for template in batch:
            task = render_task(template, 3, random.Random(template.name))
            before = await verify_repo("", task.spec, sandbox)
            await sandbox.reset()
            after = await verify_repo(task.ideal, task.spec, sandbox)
            await sandbox.reset()
            assert before["hidden_total"] == 6 and repo_reward(before, "") < 1.0, (template.name, before)
            assert after["completed"] and repo_reward(after, task.ideal) == 1.0, (template.name, after)


def scripted_policy(observation: str, lib_source: str | None) -> str:
    """A stand-in for the model (NOT a model): reads the observation text and answers with tool calls.

    Turn 1 (nothing read yet): run the tests. After a failure report naming ``f(arg) returned X, expected Y``,
    read lib.py; with lib.py read, replace the wrong ``return`` line by the one the README describes for this
    task (the script knows the add_k template's fix: ``x + k``), then run the tests again.
    """
    if lib_source is None and "FAILED" not in observation:
        return _call("run_tests")
    if lib_source is None:
        return _call("read_file", path="lib.py")
    fixed = re.sub(r"return x - (\d+)", r"return x + \1", lib_source)
    return _call("write_file", path="lib.py", content=fixed) + _call("run_tests")


@pytest.mark.anyio
async def test_scripted_multi_turn_episode_fixes_after_reading_a_test_failure() -> None:
    add_k = next(t for t in TEMPLATES if t.name == "add_k")
    task = render_task(add_k, 4, random.Random(7))
    async with open_sandbox("bwrap", Limits(memory_mb=256, pids=64, timeout_s=20)) as sandbox:
        episode = RepoEpisode(task.spec, sandbox)
        await episode.open()
        observation, lib_source, transcript = "", None, []
        for _ in range(episode.max_turns):
            reply = scripted_policy(observation, lib_source)
            messages = await episode.step(reply)
            transcript.append((reply, messages))
            observation = "\n".join(m["content"] for m in messages)
            if '"read_file"' in reply:
                lib_source = messages[0]["content"]
            if "SUMMARY" in observation and "failed=0" in observation:
                break
        facts = await episode.finish()
    first_tests = transcript[0][1][0]["content"]
    assert "FAILED" in first_tests and "expected" in first_tests  # the failure the policy read
    assert "return x - 4" in transcript[1][1][0]["content"]  # it then read the buggy source
    assert all(m["role"] == "tool" for _, ms in transcript for m in ms)
    assert "failed=0" in transcript[-1][1][-1]["content"]  # the second test run passes
    assert facts["completed"] and facts["hidden_total"] == 6 and facts["turns"] == 3


@pytest.mark.anyio
async def test_malformed_calls_and_big_output_are_tool_messages() -> None:
    task = render_task(TEMPLATES[0], 3, random.Random(1))
    async with open_sandbox("bwrap", Limits(memory_mb=256, pids=64, timeout_s=20)) as sandbox:
        episode = RepoEpisode(task.spec, sandbox, limit_bytes=256)
        await episode.open()
        messages = await episode.step('<tool_call>{"name": "bash", "arguments": {"command": </tool_call>'
                                      + _call("format_disk") + _call("read_file", path="nope.py")
                                      + _call("read_file", path="../../etc/passwd")
                                      + _call("bash", command="seq 1 5000"))
        assert [m["role"] for m in messages] == ["tool"] * 5
        assert "invalid JSON" in messages[0]["content"]
        assert "unknown tool 'format_disk'" in messages[1]["content"]
        assert "[tool error]" in messages[2]["content"] and "nope.py" in messages[2]["content"]
        assert "[tool error]" in messages[3]["content"]
        big = messages[4]["content"]
        assert big.startswith("1\n2\n") and "[... truncated " in big and big.rstrip().endswith("[exit code 0]")
        hint = await episode.step("I think the bug is in lib.py.")
        assert hint[0]["role"] == "user" and "No tool call" in hint[0]["content"]
        facts = await episode.finish()
    assert facts["tool_errors"] == 4 and not facts["completed"]


@pytest.mark.anyio
async def test_user_written_task_directory(tmp_path: Path) -> None:
    root = tmp_path / "halve"
    for sub, files in {"repo": {"calc.py": "def halve(x):\n    return x / 3\n"},
                       "tests_visible": {"test_calc.py": "from calc import halve\n\ndef test_4():\n    assert halve(4) == 2\n"},
                       "tests_hidden": {"test_more.py": "from calc import halve\n\ndef test_10():\n    assert halve(10) == 5\n"
                                                        "\ndef test_0():\n    assert halve(0) == 0\n"},
                       "fixed": {"calc.py": "def halve(x):\n    return x / 2\n"}}.items():
        (root / sub).mkdir(parents=True)
        for name, text in files.items():
            (root / sub / name).write_text(text)
    (root / "task.toml").write_text('prompt = "Fix calc.halve."\nmax_turns = 3\nsolution = "fixed"\n')
    task = load_task_dir(root)
    assert task.spec["max_turns"] == 3 and "tests/test_calc.py" in task.spec["files"]
    async with open_sandbox("bwrap", Limits(memory_mb=256, pids=64, timeout_s=20)) as sandbox:
        before = await verify_repo("", task.spec, sandbox)
        await sandbox.reset()
        after = await verify_repo(task.ideal, task.spec, sandbox)
    assert (before["hidden_passed"], before["hidden_total"]) == (1, 2)  # halve(0) passes even when wrong
    assert after["completed"] and DOMAINS["repo"].reward(after, task.ideal) == 1.0


def test_task_directory_errors_name_the_missing_part(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="task.toml is missing"):
        load_task_dir(tmp_path)
    (tmp_path / "task.toml").write_text("max_turns = 3\n")
    with pytest.raises(ValueError, match="field 'prompt'"):
        load_task_dir(tmp_path)
    (tmp_path / "task.toml").write_text('prompt = "x"\n')
    with pytest.raises(ValueError, match="directory repo/ is missing"):
        load_task_dir(tmp_path)


@pytest.mark.anyio
async def test_episode_actor_runs_repo_episodes_through_the_domains_episode() -> None:
    """What EpisodeActor opens for the repo domain (``Domain.new_episode``): a pooled sandbox, replies in,
    ``tool`` messages out; the shell domains get the terminal episode from the same interface."""
    from domains.repo import RepoTerminalEpisode
    from sandboxes import SandboxPool
    from sandboxes.verifiers import TerminalEpisode

    task = render_task(TEMPLATES[1], 3, random.Random(3))
    async with SandboxPool("bwrap", Limits(memory_mb=256, pids=64, timeout_s=20), size=1, max_size=1) as pool:
        assert isinstance(DOMAINS["terminal"].new_episode({"checks": []}, pool), TerminalEpisode)
        episode = DOMAINS["repo"].new_episode(task.spec, pool)
        assert isinstance(episode, RepoTerminalEpisode)
        await episode.open()
        failing = await episode.step(_call("run_tests"))
        assert [m["role"] for m in failing] == ["tool"] and "FAILED" in failing[0]["content"]
        assert episode.last_result is not None and episode.last_result.exit_code == 0
        bad = await episode.step(_call("nope"))
        assert "unknown tool" in bad[0]["content"] and episode.last_result.exit_code == 1
        await episode.step(task.ideal)
        for _ in range(3):  # up to max_turns=6; then a user note, and no result (the episode actor's "max_turns")
            await episode.step(_call("run_tests"))
        over = await episode.step(_call("run_tests"))
        assert over == [{"role": "user", "content": "[episode over: max_turns=6 reached]"}] and episode.last_result is None
        facts = await episode.finish()
    assert facts["completed"] and facts["turns"] == 6


@pytest.mark.anyio
async def test_generated_compact_spec_expands_in_the_sandbox() -> None:
    domain = DOMAINS["repo"]
    prompt, ideal = domain.demonstrate(random.Random(5), 0.7)
    again, spec = domain.generate(random.Random(5), 0.7)
    assert prompt == again and "files" not in spec and len(json.dumps(spec)) < 200
    async with open_sandbox("bwrap", Limits(memory_mb=256, pids=64, timeout_s=20)) as sandbox:
        before = await verify_repo("", spec, sandbox)
        await sandbox.reset()
        after = await verify_repo(ideal, spec, sandbox)
    assert not before["completed"] and after["completed"] and domain.format_score(ideal) == 1.0
