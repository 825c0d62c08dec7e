"""A 3-turn ``repo`` tool episode through the real pipeline, and the tokens trained are the tokens sampled.

Real broker, real ``rollout inference serve`` with SmolLM2-135M-Instruct (its own chat template and
tokenizer), real bwrap sandboxes under the sandbox role's actors, the InferenceActor under the supervisor.
Between the actor and the server sits a recording pass-through proxy (real HTTP both ways): it keeps every
``/generate`` request and the bytes of its answer, so "what the server sampled" is what went over the wire,
not what the actor says it received.

The prompt asks the model to repeat a ``run_tests`` call (greedy: top_k = 1; the untrained 135M model copies it and then
keeps calling tools), so the episode's first step runs the visible tests, whose output (a long log line
first, over 1,000 characters) comes back as a ``tool`` turn, whole.

Checked: the prompt declares the tools (SmolLM2 ignores ``tools=``: the Hermes block); each turn's request is
exactly prompt + everything so far (the context is never re-tokenised); the completion's tokens at
loss_mask 1 are, turn by turn and in order, the server's output ids (and their logprobs); every observation
is exactly the rendering of that step's ``tool`` messages as read from ``rollout.sandbox.results``; the
outcome is the repo verifier's, judged from the episode's own facts. Then ``rollout eval``'s episode loop
(:func:`actors.evaluate.run_episodes`) plays the same task against the same server: its requests are the
actor's, id for id (same tools declared, same tool turns, same token-in-token-out context).
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from domains import DOMAINS
from domains.repo import TEMPLATES, render_task
from actors.evaluate import EvalTask, run_episodes
from actors.inference.actor import InferenceActor, observation_ids
from modelserver.launch import LocalServer
from modelserver.client import GenerateResult, SSEParser
from modelserver.llm import render_prompt
from actors.runtime import Runtime
from actors.sandbox import SandboxResources, build_sandbox_actors
from engine.tools import BUILTIN_TOOLS
from engine.actor import RestartPolicy, Supervisor
from engine.config import EngineConfig, InferenceConfig, KafkaConfig, SandboxConfig
from engine.schemas import Completion, Outcome, SandboxResult, Task
from streams.kafka import Consumer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420), pytest.mark.anyio]

CALL = '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>'
PROMPT = f"Repeat this text exactly: {CALL}"
LOG_LINE = "LOG " + "=" * 1200
TURNS = 3


class Recorder:
    """A pass-through HTTP proxy: every request goes to ``upstream`` unchanged and its answer comes back
    streamed, chunk by chunk; each ``/generate`` request body and answer body is kept, in order."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.generations: list[tuple[dict[str, Any], bytes]] = []
        self._session: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/octet-stream")})
            await response.prepare(request)
            answer = bytearray()
            async for chunk in upstream.content.iter_any():
                answer += chunk
                await response.write(chunk)
            await response.write_eof()
        if request.path == "/generate":
            self.generations.append((json.loads(body), bytes(answer)))
        return response

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as self._session:
            await site.start()
            try:
                host, port = runner.addresses[0][:2]
                yield f"http://{host}:{port}"
            finally:
                await runner.cleanup()


def _final(answer: bytes) -> GenerateResult:
    """The last result of a recorded ``/generate`` stream (cumulative: the whole generation)."""
    parser = SSEParser()
    events = [e for e in parser.feed(answer) if e.strip() != "[DONE]"]
    assert events, answer[:200]
    return GenerateResult.from_json("recorded", 200, json.loads(events[-1]))


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal loss-mask values."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


def _spec() -> dict[str, Any]:
    add_k = next(t for t in TEMPLATES if t.name == "add_k")
    spec = render_task(add_k, 3, random.Random(7)).spec
    files = dict(spec["files"])
    files["tests/test_lib.py"] = f'print("{LOG_LINE}")\n' + files["tests/test_lib.py"]  # a long run_tests report
    return {**spec, "files": files, "max_turns": TURNS}


async def test_a_three_turn_tool_episode_trains_on_exactly_the_tokens_the_server_sampled(
        kafka_bootstrap: str, unique_name: str, real_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(real_model_dir), local_files_only=True)
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       sandbox=SandboxConfig(backend="bwrap", pool_size=1, max_sandboxes=2, memory_mb=256, pids=64,
                                             timeout_s=20),
                       inference=InferenceConfig(concurrency=1, stream_interval=8))
    task = Task(task_id="repo-tools-0", domain="repo", prompt=PROMPT, spec=_spec(), group_size=1,
                sampling={"max_new_tokens": 48, "temperature": 1.0, "top_k": 1}, max_turns=TURNS, tools=list(DOMAINS["repo"].tools))
    recorder = Recorder("")
    async with (LocalServer(real_model_dir, log_path=tmp_path / "server.log", max_batch=2) as upstream,
                Runtime(cfg, use_nats=False) as rt, SandboxResources(cfg.sandbox) as resources):
        recorder.upstream = upstream
        async with recorder.serving() as url:
            names = rt.names
            watch = Consumer(cfg.kafka, topics=[names.completions, names.outcomes, names.sandbox_results],
                             group=f"{unique_name}.watch", expect=("completion", "outcome", "sandbox_result"))
            sup = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
            sup.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "w"))
            for spec in build_sandbox_actors(rt, resources):
                sup.add_spec(spec)
            completion: Completion | None = None
            outcome: Outcome | None = None
            results: list[SandboxResult] = []
            async with watch, anyio.create_task_group() as tg:
                tg.start_soon(sup.run)
                await rt.producer.send(names.tasks, task, key=task.task_id)
                with anyio.fail_after(300):
                    while completion is None or outcome is None:
                        for r in await watch.getmany(timeout_s=0.2):
                            m = r.message
                            if isinstance(m, Completion):
                                completion = m
                            elif isinstance(m, Outcome):
                                outcome = m
                            elif isinstance(m, SandboxResult):
                                results.append(m)
                            r.ack()
                sup.drain()
            played = len(recorder.generations)
            records = await run_episodes(url, [EvalTask("repo-tools-eval", "repo", PROMPT, task.spec, TURNS)],
                                         max_new_tokens=48, concurrency=1, tokenizer=tokenizer)
            evaluated = recorder.generations[played:]

    assert completion is not None and outcome is not None
    # -- the prompt: the task's tools declared (SmolLM2's template ignores tools=: the Hermes block) ----------
    prompt_ids = completion.prompt_ids.tolist()
    assert prompt_ids == render_prompt(tokenizer, PROMPT, tools=BUILTIN_TOOLS)
    prompt_text = tokenizer.decode(prompt_ids)
    assert "<tools>\n" in prompt_text and '"name": "write_file"' in prompt_text and PROMPT in prompt_text

    # -- turn by turn: what the server sampled is what is trained on, the context never re-tokenised ---------
    ids, mask = completion.response_ids.tolist(), completion.loss_mask.tolist()
    runs = _runs(mask)
    model_runs = [(s, e) for m, s, e in runs if m == 1]
    observation_runs = [(s, e) for m, s, e in runs if m == 0]
    generations = [g for g in recorder.generations if g[0].get("rid", "").startswith(f"{task.task_id}/0#")]
    assert len(generations) == len(model_runs) == len(observation_runs) == TURNS == completion.turns
    assert [m for m, _, _ in runs] == [1, 0] * TURNS  # model turn, observation, ... (each step answered)
    for (request, answer), (start, end) in zip(generations, model_runs):
        sampled = _final(answer)
        assert request["input_ids"] == prompt_ids + ids[:start]  # prompt + the turns so far, as they were
        assert ids[start:end] == sampled.output_ids  # exactly the server's ids, in order
        assert completion.logprobs[start:end].tolist() == pytest.approx(sampled.logprobs, abs=1e-6)
    assert [t for t, m in zip(ids, mask) if m] == [t for _, a in generations for t in _final(a).output_ids]
    assert all(v == -1 for v, m in zip(completion.weight_versions.tolist(), mask) if not m)

    # -- every observation is that step's tool messages, rendered by the template, whole ---------------------
    steps = sorted((r for r in results if r.episode_id == completion.sample_id and 1 <= r.step <= TURNS),
                   key=lambda r: r.step)
    assert [r.step for r in steps] == list(range(1, TURNS + 1)) and all(r.messages for r in steps)
    for step, (start, end), (_, model_end) in zip(steps, observation_runs, model_runs):
        assert ids[start:end] == observation_ids(tokenizer, step.messages, ids[model_end - 1])
    first = str(tokenizer.decode(ids[observation_runs[0][0]:observation_runs[0][1]]))
    assert [m["role"] for m in steps[0].messages] == ["tool"] and steps[0].messages[0]["name"] == "run_tests"
    assert all(m["role"] == "tool" for r in steps for m in r.messages)  # greedy: a call every turn
    assert "<|im_start|>tool\n" in first and first.endswith("<|im_start|>assistant\n")
    assert LOG_LINE in first and "SUMMARY passed=" in first  # over 1,000 characters: no 400-character cut
    assert steps[0].messages[0]["content"] in first

    # -- the outcome: the repo verifier, judged from the episode's own final state ---------------------------
    assert completion.finish_reason != "sandbox_error" and completion.episode_facts["turns"] == TURNS
    assert outcome.verifier == "repo" and outcome.error == "" and outcome.facts == completion.episode_facts
    assert outcome.facts["hidden_total"] == 6 and outcome.facts["tool_calls"] >= 1

    # -- the evaluation plays it the same way: the same requests, id for id ------------------------------------
    assert [r["input_ids"] for r, _ in evaluated] == [r["input_ids"] for r, _ in generations]
    assert records[0].turns == TURNS and records[0].correctness == outcome.facts["hidden_passed"] / 6
