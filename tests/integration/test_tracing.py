"""One rollout is one trace: a short pipeline of every role exports to a real Jaeger v2, and one
rollout's trace holds correctly parented spans of the scheduler, inference, sandbox, reward and learner.

Jaeger is built from source on first use (``ops/infra/jaeger.py``; ``make test`` runs ``ops/jaeger.sh`` to build it
ahead of time) and runs on free loopback ports for this module, stopped by pid at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.config import (EngineConfig, InferenceConfig, KafkaConfig, LearnerConfig, NatsConfig, RewardConfig,
                           SandboxConfig, SchedulerConfig, TelemetryConfig)
from ops.deployment import Deployment
from ops.infra import InfraConfig, InfraError
from ops.infra.jaeger import JaegerServer

pytestmark = pytest.mark.anyio

SERVICE = "rollout"  # the service name of a process running several roles (ops/deployment.py)
ROLLOUT_SPANS = {"schedule", "generate", "verify", "reward", "learner.consume"}


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JaegerServer]:
    server = JaegerServer(InfraConfig.from_env(state_dir=tmp_path_factory.mktemp("jaeger")))
    try:
        try:
            server.start()
            server.wait_ready(timeout_s=60)
        except InfraError as exc:
            pytest.fail(f"could not start Jaeger for the tests: {exc}\n{exc.log_tail}", pytrace=False)
        yield server
    finally:
        server.stop()


def tag(items: list[dict[str, Any]], key: str) -> Any:
    return next((t["value"] for t in items if t["key"] == key), None)


def parent_id(span: dict[str, Any]) -> str | None:
    """The span's parent in Jaeger's model (links are FOLLOWS_FROM references, not parents)."""
    return next((r["spanID"] for r in span.get("references", []) if r["refType"] == "CHILD_OF"), None)


def traces_with(jaeger: JaegerServer, namespace: str, names: set[str]) -> list[dict[str, Any]]:
    """This deployment's traces that hold a span of each of ``names``."""
    out = []
    for t in jaeger.traces(SERVICE, limit=200):
        if not any(tag(p["tags"], "service.namespace") == namespace for p in t["processes"].values()):
            continue
        if names <= {s["operationName"] for s in t["spans"]}:
            out.append(t)
    return out


async def wait_traces(jaeger: JaegerServer, namespace: str, names: set[str]) -> list[dict[str, Any]]:
    """Poll Jaeger (it stores spans after its own batching) until such traces are there."""
    with anyio.fail_after(30):
        while not (traces := traces_with(jaeger, namespace, names)):
            await anyio.sleep(0.5)
    return traces


def check_tree(trace: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Assert one root (the scheduler's) and every other span's parent inside the trace; (spans by id, root)."""
    spans = {s["spanID"]: s for s in trace["spans"]}
    roots = [s for s in spans.values() if parent_id(s) is None]
    assert [r["operationName"] for r in roots] == ["schedule"], "the scheduler's span is the only root"
    for s in spans.values():
        assert s["traceID"] == trace["traceID"]
        if s is not roots[0]:
            assert parent_id(s) in spans, f"{s['operationName']}'s parent is outside the trace"
    return spans, roots[0]


async def run_until(cfg: EngineConfig, run_dir: Path, done: Callable[[Deployment], bool]) -> dict[str, Any]:
    """Run a deployment of every configured role until ``done``, then drain; leaving it flushes the spans.

    Returns the actors' statistics as they were when ``done`` held.
    """
    async with Deployment(cfg, run_dir=run_dir) as d:
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.run)
            with anyio.move_on_after(180):
                while not done(d):
                    await anyio.sleep(0.2)
            finished = done(d)
            stats = {name: a.statistics() for name, a in d.supervisor.actors.items()}
            d.drain()
    assert finished, f"the pipeline did not get there in 180s; actors: {stats}"
    return stats


def stat(d: Deployment, actor: str, key: str) -> Any:
    a = d.supervisor.actors.get(actor)
    return None if a is None else a.statistics().get(key)


@pytest.mark.timeout(300)
async def test_one_rollout_is_one_trace_across_every_role(kafka_bootstrap: str, nats_url: str, unique_name: str,
                                                          jaeger: JaegerServer, tmp_path: Path) -> None:
    cfg = EngineConfig(
        namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
        nats=NatsConfig(url=nats_url),
        telemetry=TelemetryConfig(tracing=True, otlp_endpoint=jaeger.otlp_endpoint),
        learner=LearnerConfig(batch_size=4, max_steps=1, checkpoint_dir=str(tmp_path / "checkpoints")),
        scheduler=SchedulerConfig(group_size=2, max_tasks=4, domains={"arith": 1.0}),
        inference=InferenceConfig(max_new_tokens=8),
        sandbox=SandboxConfig(pool_size=1, max_sandboxes=4),
        # a random tiny model scores every sample alike: keep those groups, or the learner never steps
        reward=RewardConfig(drop_zero_variance=False, group_timeout_s=60))
    await run_until(cfg, tmp_path / "run", lambda d: (stat(d, "learner", "step") or 0) >= 1)

    traces = await wait_traces(jaeger, unique_name, ROLLOUT_SPANS)
    spans, root = check_tree(traces[0])
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans.values():
        by_name.setdefault(s["operationName"], []).append(s)
    roles = {tag(s["tags"], "rollout.role") for s in spans.values()}
    assert {"scheduler", "inference", "sandbox.verify", "reward", "learner"} <= roles

    # the chain of one sample: schedule -> generate -> verify -> reward -> learner.consume
    consume = by_name["learner.consume"][0]
    reward = spans[parent_id(consume)]
    verify = spans[parent_id(reward)]
    generate = spans[parent_id(verify)]
    assert [reward["operationName"], verify["operationName"], generate["operationName"]] == \
        ["reward", "verify", "generate"]
    assert parent_id(generate) == root["spanID"]
    sample_id = tag(generate["tags"], "rollout.sample_id")
    assert sample_id and {tag(s["tags"], "rollout.sample_id") for s in (verify, reward, consume)} == {sample_id}
    assert tag(generate["tags"], "rollout.response_tokens") > 0
    assert tag(generate["tags"], "rollout.weight_version") == 0
    assert len(by_name["generate"]) == 2  # the group's two samples

    # the step that consumed it is its own trace, linked (FOLLOWS_FROM) to the sample's reward span
    step_trace_id = next(r["traceID"] for r in consume["references"] if r["refType"] == "FOLLOWS_FROM")
    step_trace = jaeger.trace(step_trace_id)
    assert step_trace is not None
    (step,) = [s for s in step_trace["spans"] if s["operationName"] == "learner.step"]
    assert tag(step["tags"], "rollout.step") == 1
    linked = {r["spanID"] for r in step["references"] if r["refType"] == "FOLLOWS_FROM"}
    assert reward["spanID"] in linked


@pytest.mark.timeout(300)
async def test_episode_steps_nest_under_their_sample(kafka_bootstrap: str, nats_url: str, unique_name: str,
                                                     jaeger: JaegerServer, tmp_path: Path) -> None:
    cfg = EngineConfig(
        namespace=unique_name, roles=["scheduler", "inference", "sandbox"],
        kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1), nats=NatsConfig(url=nats_url),
        telemetry=TelemetryConfig(tracing=True, otlp_endpoint=jaeger.otlp_endpoint),
        scheduler=SchedulerConfig(group_size=2, max_tasks=1, domains={"terminal": 1.0}),
        inference=InferenceConfig(max_new_tokens=8), sandbox=SandboxConfig(pool_size=1, max_sandboxes=4))
    stats = await run_until(cfg, tmp_path / "run",
                            lambda d: sum((stat(d, "sandbox.verify", "verified") or {}).values()) >= 2)
    assert stats["sandbox.episodes"]["closed"] == 2, f"episodes did not run to their end: {stats}"

    (trace,) = await wait_traces(jaeger, unique_name, {"schedule", "generate", "sandbox.step", "verify"})
    spans, root = check_tree(trace)
    steps = [s for s in spans.values() if s["operationName"] == "sandbox.step"]
    assert len(steps) >= 4  # each of the two episodes: open ... close
    for step in steps:
        generate = spans[parent_id(step)]
        assert generate["operationName"] == "generate"
        assert tag(step["tags"], "rollout.episode_id") == tag(generate["tags"], "rollout.sample_id")
        assert parent_id(generate) == root["spanID"]
    actions = {tag(s["tags"], "rollout.action") for s in steps}
    assert {"open", "close"} <= actions
    for verify in (s for s in spans.values() if s["operationName"] == "verify"):
        assert spans[parent_id(verify)]["operationName"] == "generate"
