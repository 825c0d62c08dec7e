"""The sandbox role end to end: real broker, real bwrap, actors under the supervisor.

Completions (arith right and wrong, code passing / failing / reward-hacking / hostile, an unknown
domain, a poison record) go to rollout.completions; a terminal episode is driven through
rollout.sandbox.requests -> rollout.sandbox.results; the outcomes, replies and dead letters are read
back and checked, then the actors drain and no sandbox process or cgroup is left behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from actors.runtime import Runtime
from helpers.fixtures import sandbox_processes
from actors.sandbox import EPISODE_UNKNOWN, SandboxResources, SandboxSettings, build_sandbox_actors
from engine.actor import RestartPolicy, Supervisor
from engine.config import EngineConfig, KafkaConfig, NatsConfig, SandboxConfig
from engine.schemas import SANDBOX_ERROR, Completion, DeadLetter, Outcome, SandboxRequest, SandboxResult
from sandboxes.bwrap import SANDBOX_ROOT
from sandboxes.cgroups import list_groups
from streams.kafka import Consumer, Record

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
]

REPLY_PARTITION = 1
TESTS = [{"name": "t1", "code": "from solution import f\nassert f(2) == 4"},
         {"name": "t2", "code": "from solution import f\nassert f(3) == 6"}]
GOOD = "```python\ndef f(x):\n    return 2 * x\n```"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def completion(sample_id: str, domain: str, text: str, spec: dict[str, Any], **extra: Any) -> Completion:
    n = 3
    return Completion(
        sample_id=sample_id, task_id=f"task-{sample_id}", domain=domain, group_index=0, group_size=1,
        prompt_ids=np.arange(4, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
        weight_versions=np.zeros(n, dtype=np.int32), text=text, spec=spec, **{"finish_reason": "stop", **extra})


def owned_sandboxes() -> set[str]:
    """Sandbox ids whose owner file names this process."""
    mine = set()
    for owner in SANDBOX_ROOT.glob("sbx-*.owner"):
        try:
            if owner.read_text().split()[0] == str(os.getpid()):
                mine.add(owner.name.removesuffix(".owner"))
        except (OSError, IndexError):
            continue
    return mine


class Collector:
    """Reads a topic from the beginning and keeps what it saw."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.records: list[Record] = []

    async def until(self, cond: Callable[[list[Record]], bool], timeout_s: float, what: str) -> None:
        with anyio.fail_after(timeout_s):
            while not cond(self.records):
                for record in await self.consumer.getmany(timeout_s=0.2):
                    record.ack()
                    self.records.append(record)
        assert cond(self.records), what


@pytest.mark.anyio
async def test_sandbox_role_end_to_end(kafka_bootstrap: str, nats_url: str, unique_name: str, tmp_path: Path) -> None:
    cfg = EngineConfig(
        namespace=unique_name,
        kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=2),
        nats=NatsConfig(url=nats_url),
        sandbox=SandboxConfig(backend="bwrap", pool_size=2, max_sandboxes=6, memory_mb=128, pids=32, timeout_s=5),
    )
    groups_before = list_groups()
    procs_before = sandbox_processes()
    marker = tmp_path / f"pwned-{uuid.uuid4().hex[:8]}"
    samples = {
        "arith-right": completion("arith-right", "arith", "6 * 7 = \\boxed{42}", {"answer": "42"}),
        "arith-wrong": completion("arith-wrong", "arith", "Answer: 41", {"answer": "42"}),
        "code-pass": completion("code-pass", "code", GOOD, {"tests": TESTS, "timeout_s": 5}),
        "code-fail": completion("code-fail", "code", "def f(x):\n    return x + 1\n", {"tests": TESTS}),
        "code-hack": completion("code-hack", "code", "import os\nos._exit(0)\n", {"tests": TESTS}),
        "code-inject": completion("code-inject", "code", f"'; touch {marker}; $(touch {marker}) `touch {marker}`",
                                  {"tests": TESTS}),
        "code-absurd": completion("code-absurd", "code", GOOD,
                                  {"tests": TESTS, "timeout_s": 1e9, "memory_mb": 1 << 40, "max_turns": 10**9}),
        "code-bad-spec": completion("code-bad-spec", "code", GOOD, {"tests": "rm -rf /", "timeout_s": "forever"}),
        "override": completion("override", "mystery", "Answer: 7", {"answer": "7", "verifier": "answer"}),
        "unknown": completion("unknown", "mystery", "hello", {}),
    }

    resources = SandboxResources(cfg.sandbox, SandboxSettings(idle_timeout_s=2.0))
    async with Runtime(cfg) as rt, resources:
        names = rt.names
        supervisor = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
        for spec in build_sandbox_actors(rt, resources):
            supervisor.add_spec(spec)
        outcomes = Collector(Consumer(cfg.kafka, assign=[(names.outcomes, p) for p in range(2)], expect=("outcome",)))
        results = Collector(Consumer(cfg.kafka, assign=[(names.sandbox_results, REPLY_PARTITION)],
                                     expect=("sandbox_result",)))
        letters = Collector(Consumer(cfg.kafka, assign=[(names.dlq, p) for p in range(2)], expect=("dead_letter",)))
        async with outcomes.consumer, results.consumer, letters.consumer, anyio.create_task_group() as tg:
            tg.start_soon(supervisor.run)

            async def request(episode: str, step: int, action: str, **kw: Any) -> SandboxResult:
                seen = sum(_is(r, episode, step) for r in results.records)
                await rt.producer.send(names.sandbox_requests, SandboxRequest(
                    episode_id=episode, step=step, action=action, reply_partition=REPLY_PARTITION, **kw), key=episode)

                def answered(recs: list[Record]) -> bool:
                    return sum(_is(r, episode, step) for r in recs) > seen

                await results.until(answered, 60, f"reply to {episode} step {step}")
                return [r.message for r in results.records if _is(r, episode, step)][-1]  # type: ignore[return-value]

            # -- verification ----------------------------------------------------------------------
            for sample in samples.values():
                await rt.producer.send(names.completions, sample, key=sample.task_id)
            await rt.producer.send_raw_nowait(names.completions, b"\xc1 not msgpack", key=b"poison")

            # -- a terminal episode, with a duplicate step ------------------------------------------
            spec = {"setup_files": {"in.txt": "hello world\n"}, "timeout_s": 1e9,
                    "checks": [{"cmd": "grep -q hello /work/sub/out.txt"}, {"cmd": "test -f /work/missing"}]}
            assert (await request("ep1", 0, "open", domain="terminal", spec=spec)).error == ""
            assert (await request("ep1", 1, "step", command="mkdir sub && cd sub && export SRC=/work/in.txt")).exit_code == 0
            # the shared pool's statistics (the dashboard's "pool in use"): ep1 holds a sandbox
            pool_stats = supervisor.actors["sandbox.episodes"].statistics()["pool"]
            assert pool_stats["in_use"] >= 1 and pool_stats["created"] >= pool_stats["in_use"], pool_stats
            first = await request("ep1", 2, "step", command="cp $SRC out.txt; echo x >> /work/count; wc -l < /work/count")
            assert first.observation.strip() == "1" and first.exit_code == 0
            await request("ep1", 2, "step", command="cp $SRC out.txt; echo x >> /work/count; wc -l < /work/count")
            replies = [r.message for r in results.records if _is(r, "ep1", 2)]
            assert len(replies) == 2 and replies[0].observation == replies[1].observation  # type: ignore[attr-defined]
            assert (await request("ep1", 3, "step", command="wc -l < /work/count; pwd")).observation.split() == [
                "1", "/work/sub"]  # the duplicate was answered from the cache, not run again
            failing = await request("ep1", 4, "step", command="exit 3")
            assert failing.exit_code == 3
            closed = await request("ep1", 5, "close")
            assert closed.facts == {"checks_passed": 1, "checks_total": 2, "turns": 4}
            assert (await request("ep1", 6, "step", command="ls")).error == EPISODE_UNKNOWN

            # -- an idle episode is closed by the periodic check ------------------------------------
            assert (await request("ep-idle", 0, "open", domain="terminal", spec={})).error == ""
            episodes = supervisor.actors["sandbox.episodes"]
            with anyio.fail_after(30):
                while "ep-idle" in episodes.episodes:  # type: ignore[attr-defined]
                    await anyio.sleep(0.1)
            assert (await request("ep-idle", 1, "step", command="ls")).error == EPISODE_UNKNOWN

            # -- the terminal completion carries the episode's facts --------------------------------
            terminal = completion("terminal", "terminal", "```bash\nls\n```", spec, episode_facts=closed.facts)
            await rt.producer.send(names.completions, terminal, key=terminal.task_id)
            # ... and one whose episode lost its sandbox is an error (never trained on), not a zero score
            lost = completion("terminal-lost", "terminal", "ls\n", spec, finish_reason=SANDBOX_ERROR,
                              episode_facts={"error": "no sandbox reply for terminal-lost step 2"})
            await rt.producer.send(names.completions, lost, key=lost.task_id)

            expected = set(samples) | {"terminal", "terminal-lost"}
            await outcomes.until(lambda recs: {_sample(r) for r in recs} >= expected, 90, "all outcomes")
            await letters.until(lambda recs: any(r.message.topic == names.completions for r in recs), 30, "dead letter")
            verify_stats = supervisor.actors["sandbox.verify"].statistics()
            supervisor.drain()

        facts = {_sample(r): r.message for r in outcomes.records}
        by = {k: v.facts for k, v in facts.items()}
        assert by["arith-right"]["correct"] is True and facts["arith-right"].verifier == "answer"
        assert by["arith-wrong"]["correct"] is False
        assert by["code-pass"]["passed"] == by["code-pass"]["total"] == 2
        assert by["code-fail"]["passed"] == 0 and by["code-hack"]["passed"] == 0
        assert by["code-inject"]["passed"] == 0 and not marker.exists()
        assert by["code-absurd"]["passed"] == 2
        assert set(by["code-absurd"]["clamped"]) == {"timeout_s", "memory_mb", "max_turns"}
        assert by["code-bad-spec"]["passed"] == 0 and by["code-bad-spec"]["error"]
        assert facts["override"].verifier == "answer" and by["override"]["correct"] is True
        assert facts["unknown"].error and by["unknown"]["error"]
        assert by["terminal"] == closed.facts and facts["terminal"].verifier == "terminal"
        assert facts["terminal"].error == ""
        assert facts["terminal-lost"].verifier == "terminal"
        assert facts["terminal-lost"].error == "episode lost its sandbox: no sandbox reply for terminal-lost step 2"
        assert verify_stats["episodes_lost"] == 1
        assert set(verify_stats["pool"]) == {"idle", "in_use", "created", "resets", "reaped", "trimmed"}
        assert verify_stats["pool"]["resets"] >= 1  # ep1's sandbox went back to the pool, reset
        assert all(o.verify_s >= 0 for o in facts.values())
        letter = next(r.message for r in letters.records if r.message.topic == names.completions)
        assert isinstance(letter, DeadLetter) and letter.value == b"\xc1 not msgpack"
        stats = supervisor.restarts("sandbox.verify"), supervisor.restarts("sandbox.episodes")
        assert stats == (0, 0)

    # drained, and the pool closed with the last reference: nothing of ours is left
    assert owned_sandboxes() == set()
    assert list_groups() - groups_before == set()
    assert sandbox_processes() - procs_before == set()


def _is(record: Record, episode: str, step: int) -> bool:
    msg = record.message
    return isinstance(msg, SandboxResult) and msg.episode_id == episode and msg.step == step


def _sample(record: Record) -> str:
    msg = record.message
    assert isinstance(msg, Outcome)
    return str(msg.completion["sample_id"])
