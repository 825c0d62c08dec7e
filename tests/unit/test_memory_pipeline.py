"""The whole pipeline over the in-memory transport (``transport.type = "memory"``), with no broker and no
NATS: scheduler -> inference actor (the local server's app in this process, tiny model) -> sandbox verify
-> reward -> learner -> weights through the control store -> the inference actor applies the new version.

The ``arith`` domain's ``answer`` verifier reads the text and runs nothing, so the sandbox pool here is
one of a backend that refuses to open a sandbox: a verification that tried one would fail the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from aiohttp.test_utils import TestServer

from actors.inference.actor import InferenceActor
from actors.learner import LearnerActor
from actors.reward import RewardActor
from actors.runtime import Runtime
from actors.sandbox import build_sandbox_actors, sandbox_resources
from actors.scheduler import SchedulerActor
from engine.actor import RestartPolicy, Supervisor
from engine.config import (ConfigError, EngineConfig, InferenceConfig, LearnerConfig, RewardConfig, SandboxConfig,
                           SchedulerConfig, TransportConfig)
from engine.schemas import Completion, Experience
from learning.core import StepReport
from modelserver.llm import load_model_dir, write_tiny_model_dir
from modelserver.local.server import ServerConfig, build_app
from sandboxes import Limits, Sandbox
from sandboxes.registry import register_sandbox_backend, unregister_sandbox_backend
from streams.memory import MemoryEventLog, MemoryStore

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

GROUP, BATCH, STEPS = 2, 4, 2
NO_SANDBOX = "test-no-sandbox"


@pytest.fixture
def no_sandbox_backend() -> Iterator[str]:
    async def refuse(limits: Limits) -> Sandbox:
        raise AssertionError("the answer verifier opened a sandbox")

    register_sandbox_backend(NO_SANDBOX, refuse, description="opens none (tests of sandbox-free verifiers)")
    try:
        yield NO_SANDBOX
    finally:
        unregister_sandbox_backend(NO_SANDBOX)


@pytest.fixture
async def local_server(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(model directory, URL) of the local server's app in this process, serving a tiny model."""
    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    server = TestServer(build_app(ServerConfig(model_dir=model_dir, max_batch=8, chunk_size=64)), port=0)
    await server.start_server()
    try:
        yield model_dir, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def test_an_unknown_transport_type_is_a_one_line_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^transport\.type: unknown transport 'carrier-pigeon'; known: kafka, memory"):
        Runtime(EngineConfig(transport=TransportConfig(type="carrier-pigeon")))


def test_the_config_picks_the_transport() -> None:
    rt = Runtime(EngineConfig(transport=TransportConfig(type="memory")))
    assert isinstance(rt.event_log, MemoryEventLog) and isinstance(rt.control, MemoryStore)
    assert rt.nats is rt.control  # the old name still reads it


async def test_the_whole_pipeline_runs_over_the_memory_transport(
        tmp_path: Path, local_server: tuple[str, str], no_sandbox_backend: str) -> None:
    model_dir, url = local_server
    cfg = EngineConfig(
        namespace="pipeline", transport=TransportConfig(type="memory"),
        scheduler=SchedulerConfig(domains={"arith": 1.0}, group_size=GROUP, max_staleness=1, curriculum=False),
        inference=InferenceConfig(model_dir=model_dir, max_new_tokens=6, temperature=1.0, concurrency=16),
        sandbox=SandboxConfig(backend=no_sandbox_backend, pool_size=0, max_sandboxes=4),
        # the tiny model scores every sample of a group alike: keep those groups, or the learner never steps
        reward=RewardConfig(drop_zero_variance=False, group_timeout_s=60),
        learner=LearnerConfig(batch_size=BATCH, lr=1e-3, publish_every=1, checkpoint_every=100,
                              checkpoint_dir=str(tmp_path / "ckpt"), max_steps=STEPS))
    _, tokenizer = load_model_dir(model_dir)
    reports: list[StepReport] = []
    async with Runtime(cfg, instance="one") as rt, sandbox_resources(cfg.sandbox) as resources:
        assert isinstance(rt.event_log, MemoryEventLog)  # picked by transport.type, not handed in
        sup = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
        for spec in build_sandbox_actors(rt, resources):
            sup.add_spec(spec)
        sup.add("inference", lambda: InferenceActor(rt, [url], tokenizer, weights_dir=tmp_path / "weights"))
        sup.add("reward", lambda: RewardActor(rt))
        sup.add("learner", lambda: LearnerActor(rt, model_dir=model_dir, on_step=reports.append))
        sup.add("scheduler", lambda: SchedulerActor(rt))
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.run)  # a role that crashes ends the test: no restarts
            with anyio.fail_after(200):
                while (len(reports) < STEPS or sup.actors["inference"].statistics()["weight_version"] < STEPS
                       or not newer_than_v0(rt.event_log, rt.names.completions)):
                    await anyio.sleep(0.05)
            inference = sup.actors["inference"].statistics()
            verify = sup.actors["sandbox.verify"].statistics()
            sup.drain()
    log = rt.event_log
    assert isinstance(log, MemoryEventLog)

    # the learner stepped on samples that came through the pipeline: generated by the inference actor,
    # verified, rewarded, and read back from the experience topic
    completions = {m.sample_id for m in log.messages(rt.names.completions) if isinstance(m, Completion)}
    experience = {m.sample_id for m in log.messages(rt.names.experience) if isinstance(m, Experience)}
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    for report in reports:
        assert len(report.trained) >= BATCH
        assert set(report.trained) <= experience <= completions
    assert verify["verified"].get("answer", 0) >= STEPS * BATCH and verify["verifier_errors"] == 0
    # each step published a version; the inference actor fetched them from the control store, applied them,
    # and generated with them
    assert inference["weight_version"] == STEPS
    assert newer_than_v0(log, rt.names.completions)


def newer_than_v0(log: object, topic: str) -> bool:
    """Whether a completion on ``topic`` has a token generated with weights the learner published."""
    assert isinstance(log, MemoryEventLog)
    return any(isinstance(m, Completion) and m.weight_versions.size and int(m.weight_versions.max()) >= 1
               for m in log.messages(topic))
