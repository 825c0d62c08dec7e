"""Pipeline throughput with tracing off vs on, measured in the same run on the same running actors.

Two stages, chosen with ``--stage``:

- ``pipeline`` (default): the generation path in one process. ``Task`` records (domain arith, groups
  of 2-4 samples of 24 tokens each, ``ignore_eos``) go to ``rollout.tasks``; an ``InferenceActor``
  generates them on a ``LocalServer`` (the embedded torch server, a child process) serving a tiny
  model, then the sandbox role's ``VerifyActor`` (answer verifier) and the ``RewardActor`` turn every
  completion into an experience. With tracing on, every task carries the traceparent of a ``schedule``
  span, as the scheduler's do; the actors then record ``generate``, ``verify`` and ``reward`` spans.
- ``verify-reward``: the cheapest stage alone, the worst case for tracing. Completions are published
  straight to ``rollout.completions``, each (with tracing on) with the traceparent of a ``generate``
  span, as the inference actor's are.

The spans that stand for upstream processes (``schedule``, ``generate``) are made before the clock
starts. The time until all N experiences of a phase are back on ``rollout.experience`` gives
samples/s. Phases run on the same actors (the tracer provider is switched between phases) in the
order off, on, off, on, ..., off: every ``on`` phase is compared with the mean of the two ``off``
phases around it, which cancels a steady drift of the machine or of the actors' state (with plain
alternation the ``on`` phase always runs second and takes the drift as overhead), and the headline
is the median of those ratios. With tracing on, every actor records and propagates its spans through
the SDK's ``BatchSpanProcessor`` to an exporter that counts and drops them (or, with ``--otlp-endpoint``, to a real
OTLP/HTTP backend such as ``ops/infra/jaeger.py``'s). The spans are recorded by the SDK's own
``TracerProvider``, as in the daemons.

    python -m loadtests.tracing_overhead [--stage pipeline|verify-reward] [--quick] [--json out.json]
                                         [--rounds K] [--aa] [--bootstrap H:P] [--nats URL]
                                         [--otlp-endpoint URL] [--sample-ratio R]
                                         [--phase-samples N] [--clock-phases C] [--no-gc-freeze]

On 2 cores the pipeline stage takes about 2 minutes with ``--quick`` and about 4 without (phases of
540 and 1800 samples, K=4 ``on`` phases by default). ``--sample-ratio`` records only that fraction of
the rollouts (``parentbased_traceidratio``, the same as ``OTEL_TRACES_SAMPLER=parentbased_traceidratio
OTEL_TRACES_SAMPLER_ARG=R`` in a deployment); the context still travels with every record. ``--aa``
runs the same schedule with tracing off in every phase: the figure it prints is the method's own bias
and noise on this machine, the floor under which an overhead cannot be told apart.

Headline: ``overhead_fraction`` = mean over the ``on`` phases of 1 - on / mean(off before, off after)
samples/s (target < 0.05), with its 95% interval (``overhead_ci95``), median and spread (the per-phase
ratios are skewed, so the median runs high). Beside it, CPU time per sample, bracketed the same way:
``cpu_overhead_fraction`` of the stage's processes together (this one, which holds every actor and
every span, plus, in the pipeline stage, the inference server child, read from ``/proc/<pid>/stat``), and ``actors_cpu_overhead_fraction`` of this process alone:
the server records no spans, so its CPU is only noise in the first figure. And, read where it is
spent rather than inferred from a difference (:class:`TracingClock`): ``attributed_overhead_fraction``,
the CPU time inside the tracing calls the actors make plus the export thread's, over the rest of the
phase's CPU time; on a CPU-bound machine throughput falls by about that fraction, and it does not
carry the phase-to-phase noise of the A/B figures. The clock runs in ``--clock-phases`` extra traced
phases after the A/B schedule (default 3), never in the A/B ``on`` phases: its own cost (two CPU-clock
reads and a wrapper per traced call, about 0.4% of the pipeline's CPU) would be charged to tracing there. With no --bootstrap (or
ROLLOUT_KAFKA_BOOTSTRAP) it starts a private broker and nats-server on free ports and stops them at
the end; with one, the inference actor subscribes to weight updates on --nats (or ROLLOUT_NATS_URL) if
given.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, cast

import anyio
import numpy as np
import opentelemetry.context as otel_context
import opentelemetry.sdk.trace as otel_sdk_trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind


from actors import tracing  # noqa: E402
from actors.inference.actor import InferenceActor  # noqa: E402
from modelserver.launch import LocalServer  # noqa: E402
from actors.reward import RewardActor  # noqa: E402
from actors.runtime import Runtime  # noqa: E402
from actors.sandbox import SandboxResources, VerifyActor  # noqa: E402
from engine.actor import Actor  # noqa: E402
from engine.config import (EngineConfig, InferenceConfig, KafkaConfig, NatsConfig, RewardConfig,  # noqa: E402
                           SandboxConfig, SchedulerConfig, SupervisionConfig, TelemetryConfig)
from engine.process import freeze_startup_heap  # noqa: E402
from engine.schemas import Completion, Experience, Message, Task  # noqa: E402
from engine.topics import Names  # noqa: E402
from loadtests._stats import ci95  # noqa: E402
from ops.telemetry import setup_tracing  # noqa: E402
from streams.kafka import Consumer  # noqa: E402

GROUP = 2  # samples per task of the verify-reward stage's synthetic completions
TOKENS = 24  # new tokens per generated sample
CONCURRENCY = 48  # generations in flight: the inference actor takes CONCURRENCY // 3 tasks at a time


@dataclasses.dataclass(frozen=True)
class Measured:
    """One phase: its samples, wall-clock seconds, and the CPU seconds of this process and of the server."""

    samples: int
    seconds: float
    cpu_s: float
    server_cpu_s: float
    gc_s: float
    """CPU seconds this process spent in the garbage collector during the phase."""


class CountingExporter(SpanExporter):
    """Counts the spans exported to it and drops them, as a daemon's exporter hands them off (an
    in-memory exporter would keep every span alive, and the garbage collector would walk them all)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Any) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class GcClock:
    """CPU time spent in Python's garbage collector (``gc.callbacks``), while entered."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.cpu_s += time.thread_time() - self._t0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


@dataclasses.dataclass(frozen=True)
class Send:
    """One record of a phase (made before its clock starts, published after) and the samples it stands for."""

    topic: str
    message: Message
    key: str
    headers: dict[str, str]
    samples: int


def upstream_headers(span_name: str, traced: bool) -> dict[str, str]:
    """The traceparent of a new root span ``span_name`` (an upstream process's), or none when not traced."""
    if not traced:
        return {}
    with tracing.tracer().start_as_current_span(span_name, context=Context(), kind=SpanKind.PRODUCER) as span:
        return tracing.trace_headers(span)


def completion(task_id: str, index: int) -> Completion:
    n = 16
    return Completion(
        sample_id=f"{task_id}/{index}", task_id=task_id, domain="arith", group_index=index,
        group_size=GROUP, prompt_ids=np.arange(8, dtype=np.int32),
        response_ids=np.arange(n, dtype=np.int32), logprobs=np.full(n, -0.5, np.float32),
        loss_mask=np.ones(n, np.uint8), weight_versions=np.zeros(n, np.int32), text="19" if index == 0 else "18",
        finish_reason="stop", spec={"answer": "19"})


def arith_task(task_id: str, g: int) -> Task:
    a, b = g % 50, (7 * g) % 50
    return Task(task_id=task_id, domain="arith", prompt=f"{a}+{b}=", spec={"answer": str(a + b)},
                group_size=2 + g % 3, sampling={"max_new_tokens": TOKENS, "ignore_eos": True})


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class TracingClock:
    """CPU time spent in tracing, counted where it is spent: on the actors' thread, inside the calls they
    make to trace (the span calls of either recorder, context attach/detach, this project's ``actors.tracing``
    helpers; the outermost call only, ``time.thread_time``), plus the span processor's export
    thread(s) (their own CPU clock). Installed for the clock phases only (not the A/B ``on`` phases,
    whose throughput it would slow); its own cost (two clock reads per call) is charged to tracing.

    The wall-clock A/B comparison says whether tracing costs anything this does not see; this says
    what the calls it does see cost, without the phase-to-phase noise.
    """

    SPAN_METHODS = ("end", "set_attribute", "set_attributes", "add_event", "add_link", "set_status",
                    "record_exception", "update_name")
    HELPERS = ("record_context", "context_of", "trace_headers", "traceparent_of", "record_attributes",
               "span_context_of")

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.calls = 0
        self.by_call: dict[str, list[float]] = {}  # "owner.name" -> [calls, CPU seconds]
        self._depth = 0
        self._patched: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        clock = self
        label = f"{getattr(owner, '__name__', owner)}.{name}".rsplit(".", 2)[-2:]
        entry = self.by_call.setdefault(".".join(label), [0, 0.0])

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if clock._depth:  # a traced call inside another: the outer one counts it
                return original(*args, **kwargs)
            clock._depth += 1
            t0 = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                clock.cpu_s += spent
                clock.calls += 1
                entry[0] += 1
                entry[1] += spent
                clock._depth -= 1

        setattr(owner, name, timed)
        self._patched.append((owner, name, original))

    def __enter__(self) -> TracingClock:
        self._wrap(otel_sdk_trace.Tracer, "start_span")
        for name in self.SPAN_METHODS:
            self._wrap(otel_sdk_trace.Span, name)
        for name in ("attach", "detach"):
            self._wrap(otel_context, name)
        for name in self.HELPERS:
            self._wrap(tracing, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


def exporter_threads_cpu_s() -> float:
    """CPU seconds so far of the span processors' export threads in this process."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("OtelBatch") and thread.ident is not None:
            with contextlib.suppress(OSError, ProcessLookupError):
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


class Stage(abc.ABC):
    """Actors on one runtime, the records each phase feeds them, and a consumer counting the experiences
    they emit."""

    name: ClassVar[str]
    phase_samples: ClassVar[tuple[int, int]]  # samples per phase: (--quick, full)
    warmup_samples: ClassVar[int]

    def __init__(self, bootstrap: str, nats_url: str | None, gc_freeze: bool = True) -> None:
        self.cfg = EngineConfig(namespace=f"tracing-overhead-{uuid.uuid4().hex[:8]}",
                                kafka=KafkaConfig(bootstrap=bootstrap, default_partitions=4),
                                nats=NatsConfig(url=nats_url) if nats_url else NatsConfig(),
                                scheduler=SchedulerConfig(group_size=3),  # the tasks' mean group
                                inference=InferenceConfig(concurrency=CONCURRENCY),
                                sandbox=SandboxConfig(pool_size=0, max_sandboxes=64),
                                reward=RewardConfig(drop_zero_variance=False, group_timeout_s=120),
                                supervision=SupervisionConfig(gc_freeze=gc_freeze))
        self.use_nats = False
        self.seen: dict[str, int] = {}

    @abc.abstractmethod
    async def start_actors(self, rt: Runtime, stack: contextlib.AsyncExitStack) -> list[Actor]:
        """The stage's actors (what they need, such as a server, is entered into ``stack``)."""

    @abc.abstractmethod
    def sends(self, names: Names, prefix: str, samples: int, traced: bool) -> list[Send]:
        """About ``samples`` samples' worth of records, with task ids ``{prefix}-{n}``."""

    def server_cpu_seconds(self) -> float:
        """CPU time so far of the stage's inference server process (none by default)."""
        return 0.0

    async def run_phases(self, phases: list[tuple[str, int]] | list[tuple[str, int, str]],
                         otlp_endpoint: str | None) -> list[dict[str, Any]]:
        """Warm up, then run each (mode, samples[, recorder]) phase; returns one row per phase."""
        rows = []
        async with contextlib.AsyncExitStack() as stack:
            rt = await stack.enter_async_context(Runtime(self.cfg, instance="loadtest", use_nats=self.use_nats))
            actors = await self.start_actors(rt, stack)
            results = await Consumer(self.cfg.kafka, assign_topics=[rt.names.experience],
                                     expect=(Experience.SCHEMA,), client_id="loadtest-experience").start()
            try:
                async with anyio.create_task_group() as tg:
                    for actor in actors:
                        tg.start_soon(actor.run)
                    tg.start_soon(self._count, results)
                    await self._phase(rt, "warmup", self.warmup_samples, traced=False)  # joins, first fetches
                    if self.cfg.supervision.gc_freeze:  # as a Deployment does once it has started
                        freeze_startup_heap()
                    for mode, samples, *recorder in phases:
                        rows.append(await self._run_mode(rt, mode, samples, otlp_endpoint, *recorder))
                    for actor in actors:
                        actor.request_drain()
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await results.close()
        return rows

    async def _run_mode(self, rt: Runtime, mode: str, samples: int, otlp_endpoint: str | None,
                        tracer: str = "sdk") -> dict[str, Any]:
        traced = mode in ("on", "clock")  # the --aa run labels phases "on" that trace nothing ("on-aa")
        exporter = CountingExporter() if otlp_endpoint is None else None
        shutdown = setup_tracing(TelemetryConfig(tracing=traced, otlp_endpoint=otlp_endpoint, tracer=tracer),
                                 "rollout-loadtest", exporter=exporter)
        clock = TracingClock()
        try:
            exporter0 = exporter_threads_cpu_s()
            m = await self._phase(rt, f"{mode}-{uuid.uuid4().hex[:6]}", samples, traced=traced,
                                  clock=clock if mode == "clock" else None)
            exporter_cpu = exporter_threads_cpu_s() - exporter0
        finally:
            shutdown()  # flushes: the batch exporter works beside the pipeline, as in a daemon
        spans = exporter.spans if exporter is not None else None
        return {"mode": mode.removesuffix("-aa"), "tracer": tracer, "samples": m.samples, "seconds": m.seconds, "samples_per_s": m.samples / m.seconds,
                "cpu_ms_per_sample": 1000 * (m.cpu_s + m.server_cpu_s) / m.samples,
                "actors_cpu_ms_per_sample": 1000 * m.cpu_s / m.samples,
                "gc_ms_per_sample": 1000 * m.gc_s / m.samples,
                "tracing_calls_ms_per_sample": 1000 * clock.cpu_s / m.samples,
                "export_thread_ms_per_sample": 1000 * exporter_cpu / m.samples,
                "in_tracing_ms_per_sample": 1000 * (clock.cpu_s + exporter_cpu) / m.samples,
                "traced_calls_per_sample": clock.calls / m.samples,
                # call -> [calls per sample, CPU microseconds per sample]
                "tracing_by_call": {k: [round(c / m.samples, 2), round(1e6 * t / m.samples, 1)]
                                    for k, (c, t) in sorted(clock.by_call.items(), key=lambda kv: -kv[1][1]) if c},
                "server_cpu_ms_per_sample": 1000 * m.server_cpu_s / m.samples, "spans": spans}

    async def _phase(self, rt: Runtime, prefix: str, samples: int, traced: bool,
                     clock: TracingClock | None = None) -> Measured:
        """Publish about ``samples`` samples' worth of records under ``prefix``; measured until all their
        experiences are back.

        The records, and the upstream spans whose traceparent they carry, are made before the clock starts.
        """
        sends = self.sends(rt.names, prefix, samples, traced)
        n = sum(s.samples for s in sends)
        self.seen[prefix] = 0
        with GcClock() as gc_clock, clock if clock is not None else contextlib.nullcontext():
            t0, cpu0, server0 = time.perf_counter(), time.process_time(), self.server_cpu_seconds()
            for s in sends:
                await rt.producer.wait_room()
                rt.producer.send_nowait(s.topic, s.message, key=s.key, headers=s.headers)
            with anyio.fail_after(300):
                while self.seen[prefix] < n:
                    await anyio.sleep(0.005)
            return Measured(n, time.perf_counter() - t0, time.process_time() - cpu0,
                            self.server_cpu_seconds() - server0, gc_clock.cpu_s)

    async def _count(self, results: Consumer) -> None:
        while True:
            for r in await results.getmany(timeout_s=0.1):
                prefix = cast(Experience, r.message).task_id.rsplit("-", 1)[0]  # rollout.experience only
                if prefix in self.seen:
                    self.seen[prefix] += 1
                r.ack()


class VerifyRewardStage(Stage):
    """Verify + reward fed synthetic completions: the cheapest stage, the worst case for tracing."""

    name = "verify-reward"
    phase_samples = (1000, 4000)
    warmup_samples = 200

    async def start_actors(self, rt: Runtime, stack: contextlib.AsyncExitStack) -> list[Actor]:
        return [VerifyActor(rt, SandboxResources(self.cfg.sandbox)), RewardActor(rt)]

    def sends(self, names: Names, prefix: str, samples: int, traced: bool) -> list[Send]:
        out: list[Send] = []
        for g in range(samples // GROUP):
            task_id = f"{prefix}-{g}"
            out += [Send(names.completions, completion(task_id, i), task_id, upstream_headers("generate", traced), 1)
                    for i in range(GROUP)]
        return out


class PipelineStage(Stage):
    """Inference on a local tiny-model server, then verify + reward: the generation path."""

    name = "pipeline"
    phase_samples = (540, 1800)
    warmup_samples = 360  # the first phases of a fresh server and pool run slower

    def __init__(self, bootstrap: str, nats_url: str | None, gc_freeze: bool = True) -> None:
        super().__init__(bootstrap, nats_url, gc_freeze)
        self.use_nats = nats_url is not None  # the inference actor's weight subscription
        self.server_pid: int | None = None

    async def start_actors(self, rt: Runtime, stack: contextlib.AsyncExitStack) -> list[Actor]:
        from modelserver.llm import load_model_dir, write_tiny_model_dir  # torch: only this stage needs it

        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-tracing-overhead-")))
        model_dir = write_tiny_model_dir(work / "model", seed=0)
        _, tokenizer = load_model_dir(model_dir)
        server = LocalServer(model_dir, log_path=work / "server.log", max_batch=64)
        url = await stack.enter_async_context(server)
        assert server.proc is not None
        self.server_pid = server.proc.pid
        return [InferenceActor(rt, [url], tokenizer, weights_dir=work / "weights"),
                VerifyActor(rt, SandboxResources(self.cfg.sandbox)), RewardActor(rt)]

    def sends(self, names: Names, prefix: str, samples: int, traced: bool) -> list[Send]:
        out: list[Send] = []
        while sum(s.samples for s in out) < samples:
            task = arith_task(f"{prefix}-{len(out)}", len(out))
            out.append(Send(names.tasks, task, task.task_id, upstream_headers("schedule", traced), task.group_size))
        return out

    def server_cpu_seconds(self) -> float:
        return 0.0 if self.server_pid is None else cpu_seconds_of(self.server_pid)


STAGES: dict[str, type[Stage]] = {s.name: s for s in (PipelineStage, VerifyRewardStage)}


@contextlib.contextmanager
def _infra(bootstrap: str | None, nats_url: str | None) -> Iterator[tuple[str, str | None]]:
    """(Kafka bootstrap, NATS URL or None): the given ones, or a private stack's."""
    if bootstrap:
        yield bootstrap, nats_url
        return
    from loadtests._infra import private_stack  # started on free ports, stopped by pid

    with private_stack() as stack:
        yield stack


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'phase':<8}{'mode':<9}{'samples':>9}{'seconds':>10}{'samples/s':>12}{'cpu ms/sample':>15}"
          f"{'of it actors':>14}{'in tracing':>12}{'in gc':>8}{'spans':>8}")
    for i, r in enumerate(rows):
        spans = "-" if r["spans"] is None else str(r["spans"])
        mode = f"on/{r['tracer']}" if r["mode"] == "on" else r["mode"]
        print(f"{i:<8}{mode:<9}{r['samples']:>9}{r['seconds']:>10.2f}{r['samples_per_s']:>12.1f}"
              f"{r['cpu_ms_per_sample']:>15.3f}{r['actors_cpu_ms_per_sample']:>14.3f}{r['in_tracing_ms_per_sample']:>12.3f}"
              f"{r['gc_ms_per_sample']:>8.3f}{spans:>8}")


def bracketed(rows: list[dict[str, Any]], key: str, higher_is_better: bool) -> list[float]:
    """Per ``on`` phase: its overhead in ``key`` against the mean of the ``off`` phases either side.

    ``rows`` alternate off, on, off, ..., off. Throughput: 1 - on / off; a cost (CPU per sample):
    on / off - 1. Either way a positive figure means tracing costs that fraction.
    """
    out = []
    for i in range(1, len(rows) - 1, 2):
        assert rows[i]["mode"] == "on" and rows[i - 1]["mode"] == rows[i + 1]["mode"] == "off", rows
        off = (rows[i - 1][key] + rows[i + 1][key]) / 2
        out.append(1 - rows[i][key] / off if higher_is_better else rows[i][key] / off - 1)
    return out


def split_by_recorder(rows: list[dict[str, Any]], recorders: tuple[str, ...]) -> dict[str, dict[str, list[float]]]:
    """Per recorder, the :func:`bracketed` overheads of its ``on`` phases, in order: throughput
    (``samples_per_s``), CPU per sample of the stage and of the actors' process."""
    on_recorders = [r["tracer"] for r in rows if r["mode"] == "on"]
    out: dict[str, dict[str, list[float]]] = {name: {} for name in recorders}
    for key in ("samples_per_s", "cpu_ms_per_sample", "actors_cpu_ms_per_sample"):
        overheads = bracketed(rows, key, higher_is_better=key == "samples_per_s")
        for name in recorders:
            out[name][key] = [v for v, t in zip(overheads, on_recorders) if t == name]
    return out


def paired_differences(first: list[float], second: list[float]) -> list[float]:
    """``second[i] - first[i]``: with the recorders alternating, each phase of the second against the
    phase of the first just before it (an unpaired last phase is left out)."""
    return [b - a for a, b in zip(first, second)]


def median_of(rows: list[dict[str, Any]], mode: str, key: str, digits: int = 4) -> float:
    """The median of ``key`` over the ``mode`` phases, rounded."""
    return round(float(np.median([r[key] for r in rows if r["mode"] == mode])), digits)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.sample_ratio is not None:  # read by the SDK's TracerProvider when tracing is set up
        os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        os.environ["OTEL_TRACES_SAMPLER_ARG"] = str(args.sample_ratio)
    stage_type = STAGES[args.stage]
    samples = args.phase_samples or stage_type.phase_samples[0 if args.quick else 1]
    on = "on-aa" if args.aa else "on"
    recorders = ("sdk",)  # the SDK's TracerProvider: the only recorder
    primary = recorders[0]
    phases: list[tuple[str, int, str]] = []
    for k in range(args.rounds):
        phases += [("off", samples, primary), (on, samples, recorders[k % len(recorders)])]
    phases += [("off", samples, primary)] + [("clock", samples, primary)] * (0 if args.aa else args.clock_phases)
    with _infra(args.bootstrap, args.nats) as (bootstrap, nats_url):
        stage = stage_type(bootstrap, nats_url, gc_freeze=not args.no_gc_freeze)
        all_rows = await stage.run_phases(phases, args.otlp_endpoint)
    _print_table(all_rows)
    rows = [r for r in all_rows if r["mode"] != "clock"]  # the A/B schedule: off, on, ..., off
    clock_rows = [r for r in all_rows if r["mode"] == "clock"]
    by_recorder = split_by_recorder(rows, recorders)
    throughput = by_recorder[primary]["samples_per_s"]  # the headline figures: the first recorder's
    cpu = by_recorder[primary]["cpu_ms_per_sample"]
    actors_cpu = by_recorder[primary]["actors_cpu_ms_per_sample"]
    on_rows = [r for r in rows if r["mode"] == "on" and r["spans"] is not None]
    # Attributed: the CPU measured inside tracing, against what the same phase spent on everything else
    # (on a CPU-bound machine, throughput falls by about this fraction). Only the clock phases measure it.
    attributed = [r["in_tracing_ms_per_sample"] / (r["cpu_ms_per_sample"] - r["in_tracing_ms_per_sample"])
                  for r in clock_rows] or [0.0]
    out: dict[str, Any] = {
        "stage": args.stage,
        "aa_calibration": bool(args.aa),
        "samples_per_phase": rows[0]["samples"],
        "rounds": args.rounds,
        "exporter": "otlp" if args.otlp_endpoint else "counting",
        "tracer": primary,
        "sample_ratio": 1.0 if args.sample_ratio is None else args.sample_ratio,
        "gc_freeze": not args.no_gc_freeze,
        "off_samples_per_s": median_of(rows, "off", "samples_per_s", 1),
        "on_samples_per_s": median_of(rows, "on", "samples_per_s", 1),
        # the mean over the on phases: the per-phase ratios are skewed, so their median is biased
        # (+2.8% in a 100-round --aa run whose mean was +1.2%)
        "overhead_fraction": round(float(np.mean(throughput)), 4),
        # the mean's 95% interval (normal approximation over the on phases; None with one round)
        "overhead_ci95": ci95(throughput),
        "overhead_median": round(float(np.median(throughput)), 4),
        "overhead_min": round(min(throughput), 4),
        "overhead_max": round(max(throughput), 4),
        "cpu_overhead_fraction": round(float(np.mean(cpu)), 4),
        "actors_cpu_overhead_fraction": round(float(np.mean(actors_cpu)), 4),
        "actors_cpu_overhead_min": round(min(actors_cpu), 4),
        "actors_cpu_overhead_max": round(max(actors_cpu), 4),
        "attributed_overhead_fraction": round(float(np.median(attributed)), 4),
        "attributed_overhead_max": round(max(attributed), 4),
        "clock_phases": len(clock_rows),
        "tracing_calls_ms_per_sample": median_of(clock_rows, "clock", "tracing_calls_ms_per_sample") if clock_rows else 0.0,
        "export_thread_ms_per_sample": median_of(clock_rows, "clock", "export_thread_ms_per_sample") if clock_rows else 0.0,
        "traced_calls_per_sample": median_of(clock_rows, "clock", "traced_calls_per_sample", 2) if clock_rows else 0.0,
        "off_cpu_ms_per_sample": median_of(rows, "off", "cpu_ms_per_sample"),
        "off_gc_ms_per_sample": median_of(rows, "off", "gc_ms_per_sample"),
        "on_gc_ms_per_sample": median_of(rows, "on", "gc_ms_per_sample"),
        "off_actors_cpu_ms_per_sample": median_of(rows, "off", "actors_cpu_ms_per_sample"),
        # max: a span that ends just after its phase's last experience is sent misses that phase's exporter
        "spans_per_sample": round(max(r["spans"] / r["samples"] for r in on_rows), 2) if on_rows and not args.aa else None,
    }
    print(f"\n{'on vs its neighbours':<22}{'median':>9}{'min':>9}{'max':>9}{'mean':>9}{'95% CI of mean':>20}")
    for name, values in (("throughput overhead", throughput), ("CPU/sample overhead", cpu),
                         ("actors CPU/sample", actors_cpu), ("CPU in tracing", attributed)):
        ci = ci95(values)
        shown = "-" if ci is None else f"{ci[0]:+.3f}..{ci[1]:+.3f}"
        print(f"{name:<22}{np.median(values):>+9.3f}{min(values):>+9.3f}{max(values):>+9.3f}{np.mean(values):>+9.3f}"
              f"{shown:>20}")
    out["tracing_by_call"] = clock_rows[-1]["tracing_by_call"] if clock_rows else {}
    if out["tracing_by_call"]:
        print(f"\n{'where tracing CPU goes (last clock phase)':<42}{'calls/sample':>13}{'us/sample':>11}")
        for call, (calls, us) in out["tracing_by_call"].items():
            print(f"{call:<42}{calls:>13.2f}{us:>11.1f}")
    print("\nheadline:", {k: out[k] for k in ("stage", "aa_calibration", "overhead_fraction", "cpu_overhead_fraction",
                                            "actors_cpu_overhead_fraction", "attributed_overhead_fraction")})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=list(STAGES), default=PipelineStage.name,
                   help="the generation path (default), or verify + reward alone (the worst case)")
    p.add_argument("--quick", action="store_true", help="shorter phases: a smoke run")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    p.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"))
    p.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL"),
                   help="with --bootstrap: the NATS server of the inference actor's weight subscription")
    p.add_argument("--otlp-endpoint", help="export to this OTLP/HTTP backend instead of memory")
    p.add_argument("--sample-ratio", type=float, help="record this fraction of the rollouts (default: all)")
    p.add_argument("--phase-samples", type=int,
                   help="samples per phase (default: the stage's; shorter phases, more rounds: the machine's "
                        "slow spells fall on both sides of more comparisons)")
    p.add_argument("--rounds", type=int, default=4, help="on phases, each between two off phases (default 4)")
    p.add_argument("--clock-phases", type=int, default=3,
                   help="traced phases after the A/B schedule that measure the CPU inside tracing (default 3; "
                        "the clock's own cost stays out of the A/B phases)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up heap in the garbage collector's reach (supervision.gc_freeze = false)")
    p.add_argument("--aa", action="store_true",
                   help="calibration: trace nothing in the 'on' phases too; prints the method's bias and noise")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.clock_phases < 0:
        p.error(f"--clock-phases must be >= 0, got {args.clock_phases}")
    if args.phase_samples is not None and args.phase_samples < 60:
        p.error(f"--phase-samples must be >= 60, got {args.phase_samples}")
    out = anyio.run(main_async, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
