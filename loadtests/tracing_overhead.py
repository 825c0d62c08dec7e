"""Pipeline throughput with tracing off vs on, measured in the same run on the same running actors.

A verify + reward pipeline (the sandbox role's ``VerifyActor`` with the answer verifier, then the
``RewardActor``) processes N completions published to ``rollout.completions``; the time until all N
experiences are back on ``rollout.experience`` gives samples/s. Phases alternate off, on, off, on, ...
on the same actors (the tracer provider is switched between phases), and each mode keeps its best
phase, so a noisy machine hurts both alike. With tracing on, every completion carries the traceparent
of a ``generate`` span, as the inference actor's do, and every actor records and propagates its spans
through the SDK's ``BatchSpanProcessor`` to an in-memory exporter (or, with ``--otlp-endpoint``, to a
real OTLP/HTTP backend such as ``ops/infra/jaeger.py``'s).

    python loadtests/tracing_overhead.py [--quick] [--json out.json] [--bootstrap H:P] [--otlp-endpoint URL]
                                         [--sample-ratio R]

``--sample-ratio`` records only that fraction of the rollouts (``parentbased_traceidratio``, the same as
``OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=R`` in a deployment); the
context still travels with every record.

Headline: ``overhead_fraction`` = 1 - on / off samples/s (best phase of each; target < 0.05). Beside it,
``cpu_overhead_fraction``: this process's CPU time per sample, on / off - 1 (least of each), which other
processes' load disturbs less than wall-clock throughput. With no --bootstrap (or
ROLLOUT_KAFKA_BOOTSTRAP) it starts a private broker and nats-server on free ports and stops them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors import tracing  # noqa: E402
from actors.reward import RewardActor  # noqa: E402
from actors.runtime import Runtime  # noqa: E402
from actors.sandbox import SandboxResources, VerifyActor  # noqa: E402
from engine.config import (EngineConfig, KafkaConfig, RewardConfig, SandboxConfig,  # noqa: E402
                           TelemetryConfig)
from engine.schemas import Completion, Experience  # noqa: E402
from ops.telemetry import setup_tracing  # noqa: E402
from streams.kafka import Consumer  # noqa: E402

GROUP = 2


def completion(task_id: str, index: int) -> Completion:
    n = 16
    return Completion(
        sample_id=f"{task_id}/{index}", task_id=task_id, domain="arith", group_index=index, group_size=GROUP,
        prompt_ids=np.arange(8, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
        logprobs=np.full(n, -0.5, np.float32), loss_mask=np.ones(n, np.uint8),
        weight_versions=np.zeros(n, np.int32), text="19" if index == 0 else "18", finish_reason="stop",
        spec={"answer": "19"})


class Pipeline:
    """Verify + reward actors on one runtime, and a consumer counting the experiences they emit."""

    def __init__(self, bootstrap: str) -> None:
        self.cfg = EngineConfig(namespace=f"tracing-overhead-{uuid.uuid4().hex[:8]}",
                                kafka=KafkaConfig(bootstrap=bootstrap, default_partitions=4),
                                sandbox=SandboxConfig(pool_size=0, max_sandboxes=64),
                                reward=RewardConfig(drop_zero_variance=False, group_timeout_s=120))
        self.seen: dict[str, int] = {}

    async def run_phases(self, phases: list[tuple[str, int]], otlp_endpoint: str | None) -> list[dict[str, Any]]:
        """Warm up, then run each (mode, samples) phase; returns one row per phase."""
        rows = []
        async with Runtime(self.cfg, instance="loadtest", use_nats=False) as rt:
            resources = SandboxResources(self.cfg.sandbox)
            actors = [VerifyActor(rt, resources), RewardActor(rt)]
            results = await Consumer(self.cfg.kafka, assign_topics=[rt.names.experience],
                                     expect=(Experience.SCHEMA,), client_id="loadtest-experience").start()
            try:
                async with anyio.create_task_group() as tg:
                    for actor in actors:
                        tg.start_soon(actor.run)
                    tg.start_soon(self._count, results)
                    await self._phase(rt, "warmup", GROUP * 8, traced=False)  # group joins, first fetches
                    for mode, samples in phases:
                        rows.append(await self._run_mode(rt, mode, samples, otlp_endpoint))
                    for actor in actors:
                        actor.request_drain()
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await results.close()
        return rows

    async def _run_mode(self, rt: Runtime, mode: str, samples: int, otlp_endpoint: str | None) -> dict[str, Any]:
        exporter = InMemorySpanExporter() if otlp_endpoint is None else None
        shutdown = setup_tracing(TelemetryConfig(tracing=mode == "on", otlp_endpoint=otlp_endpoint),
                                 "rollout-loadtest", exporter=exporter)
        try:
            seconds, cpu = await self._phase(rt, f"{mode}-{uuid.uuid4().hex[:6]}", samples, traced=mode == "on")
        finally:
            shutdown()  # flushes: the batch exporter works beside the pipeline, as in a daemon
        spans = len(exporter.get_finished_spans()) if exporter is not None else None
        return {"mode": mode, "samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
                "cpu_ms_per_sample": 1000 * cpu / samples, "spans": spans}

    async def _phase(self, rt: Runtime, prefix: str, samples: int, traced: bool) -> tuple[float, float]:
        """Publish ``samples`` completions under ``prefix``; (seconds, CPU seconds of this process) until all
        their experiences are back.

        The completions' ``generate`` spans (the inference actor's, in another process in a deployment)
        are made before the clock starts: only the verify and reward actors' cost is measured.
        """
        headers: list[dict[str, str]] = []
        for _ in range(samples):
            if traced:
                with tracing.tracer().start_as_current_span("generate") as span:
                    headers.append(tracing.trace_headers(span))
            else:
                headers.append({})
        self.seen[prefix] = 0
        t0, cpu0 = time.perf_counter(), time.process_time()
        for g in range(samples // GROUP):
            task_id = f"{prefix}-{g}"
            for i in range(GROUP):
                await rt.producer.wait_room()
                rt.producer.send_nowait(rt.names.completions, completion(task_id, i), key=task_id,
                                        headers=headers[g * GROUP + i])
        with anyio.fail_after(300):
            while self.seen[prefix] < samples:
                await anyio.sleep(0.005)
        return time.perf_counter() - t0, time.process_time() - cpu0

    async def _count(self, results: Consumer) -> None:
        while True:
            for r in await results.getmany(timeout_s=0.1):
                prefix = r.message.task_id.rsplit("-", 1)[0]  # type: ignore[union-attr]
                if prefix in self.seen:
                    self.seen[prefix] += 1
                r.ack()


@contextlib.contextmanager
def _kafka(bootstrap: str | None) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    from loadtests._infra import private_stack  # started on free ports, stopped by pid

    with private_stack() as (b, _nats):
        yield b


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.sample_ratio is not None:  # read by the SDK's TracerProvider when tracing is set up
        os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        os.environ["OTEL_TRACES_SAMPLER_ARG"] = str(args.sample_ratio)
    samples = 1000 if args.quick else 4000
    rounds = 3
    phases = [(mode, samples) for _ in range(rounds) for mode in ("off", "on")]
    with _kafka(args.bootstrap) as bootstrap:
        rows = await Pipeline(bootstrap).run_phases(phases, args.otlp_endpoint)
    print(f"{'phase':<8}{'mode':<6}{'samples':>9}{'seconds':>10}{'samples/s':>12}{'cpu ms/sample':>15}{'spans':>8}")
    for i, r in enumerate(rows):
        spans = "-" if r["spans"] is None else str(r["spans"])
        print(f"{i:<8}{r['mode']:<6}{r['samples']:>9}{r['seconds']:>10.2f}{r['samples_per_s']:>12.0f}"
              f"{r['cpu_ms_per_sample']:>15.3f}{spans:>8}")
    best = {m: max(r["samples_per_s"] for r in rows if r["mode"] == m) for m in ("off", "on")}
    cpu = {m: min(r["cpu_ms_per_sample"] for r in rows if r["mode"] == m) for m in ("off", "on")}
    on_rows = [r for r in rows if r["mode"] == "on" and r["spans"] is not None]
    out: dict[str, Any] = {
        "samples_per_phase": samples,
        "rounds": rounds,
        "exporter": "otlp" if args.otlp_endpoint else "in_memory",
        "sample_ratio": 1.0 if args.sample_ratio is None else args.sample_ratio,
        "off_samples_per_s": round(best["off"], 1),
        "on_samples_per_s": round(best["on"], 1),
        "overhead_fraction": round(1 - best["on"] / best["off"], 4),
        "off_cpu_ms_per_sample": round(cpu["off"], 4),
        "on_cpu_ms_per_sample": round(cpu["on"], 4),
        "cpu_overhead_fraction": round(cpu["on"] / cpu["off"] - 1, 4),
        "spans_per_sample": round(on_rows[0]["spans"] / on_rows[0]["samples"], 2) if on_rows else None,
    }
    print("\nheadline:", {k: out[k] for k in ("off_samples_per_s", "on_samples_per_s", "overhead_fraction",
                                            "cpu_overhead_fraction")})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run under a minute")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    p.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"))
    p.add_argument("--otlp-endpoint", help="export to this OTLP/HTTP backend instead of memory")
    p.add_argument("--sample-ratio", type=float, help="record this fraction of the rollouts (default: all)")
    args = p.parse_args()
    out = anyio.run(main_async, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
