"""Token streaming granularity: ``inference.stream_interval`` N vs 1, in the same run on the same actors.

The inference actor sends a generation's new tokens to ``rollout.tokens`` as they come. With
``stream_interval = 1`` every chunk the server streams (one decode step: usually one token) becomes a
Kafka record; with N, one record carries N tokens or more (the rest when the generation ends). This
measures what that saves on the generation path: the tracing benchmark's ``pipeline`` stage
(``loadtests/tracing_overhead.py``: tasks -> inference on a local tiny-model server -> verify ->
reward, tracing off throughout), with phases in the order 1, N, 1, N, ..., 1, each N phase compared
with the mean of the two phases around it (which cancels a steady drift of the machine).

Figures: ``speedup`` = mean over the N phases of samples/s against their neighbours (> 1: faster),
with its 95% interval; CPU per sample of the stage's processes (actors and inference server) and of
the whole machine (``/proc/stat``, all cores: this includes the Kafka broker, which handles every
record), as ratios the same way (< 1: cheaper).

    python -m loadtests.stream_interval [--interval N] [--quick] [--rounds K] [--json out.json]
                                        [--bootstrap H:P] [--nats URL]

With no --bootstrap (or ROLLOUT_KAFKA_BOOTSTRAP) it starts a private broker and nats-server on free
ports and stops them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import anyio
import numpy as np


from actors.inference.actor import InferenceActor  # noqa: E402
from actors.runtime import Runtime  # noqa: E402
from engine.actor import Actor  # noqa: E402
from loadtests._stats import ci95, machine_cpu_jiffies  # noqa: E402
from loadtests.tracing_overhead import PipelineStage, _infra, bracketed  # noqa: E402


class IntervalStage(PipelineStage):
    """The pipeline stage with the inference actor's stream interval switched per phase, tracing off."""

    def __init__(self, bootstrap: str, nats_url: str | None, interval: int) -> None:
        super().__init__(bootstrap, nats_url)
        self.interval = interval
        self.inference: list[InferenceActor] = []

    async def start_actors(self, rt: Runtime, stack: contextlib.AsyncExitStack) -> list[Actor]:
        actors = await super().start_actors(rt, stack)
        self.inference = [a for a in actors if isinstance(a, InferenceActor)]
        return actors

    async def _run_mode(self, rt: Runtime, mode: str, samples: int, otlp_endpoint: str | None,
                        tracer: str = "sdk") -> dict[str, Any]:
        for actor in self.inference:
            actor.stream_interval = self.interval if mode == "on" else 1
        hz = os.sysconf("SC_CLK_TCK")
        busy0, _ = machine_cpu_jiffies()
        chunks0 = sum(a.chunks_out for a in self.inference)
        # "on-aa": a phase labelled "on" that traces nothing (the tracing benchmark's calibration mode)
        row = await super()._run_mode(rt, "on-aa" if mode == "on" else "off", samples, otlp_endpoint, tracer)
        busy1, _ = machine_cpu_jiffies()
        row["machine_cpu_ms_per_sample"] = 1000 * (busy1 - busy0) / hz / row["samples"]
        row["records_per_sample"] = (sum(a.chunks_out for a in self.inference) - chunks0) / row["samples"]
        return row


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    samples = args.phase_samples or IntervalStage.phase_samples[0 if args.quick else 1]
    phases = [(mode, samples) for _ in range(args.rounds) for mode in ("off", "on")] + [("off", samples)]
    with _infra(args.bootstrap, args.nats) as (bootstrap, nats_url):
        rows = await IntervalStage(bootstrap, nats_url, args.interval).run_phases(phases, None)
    print(f"{'phase':<7}{'interval':>9}{'samples':>9}{'seconds':>9}{'samples/s':>11}{'stage CPU ms/sample':>21}"
          f"{'machine CPU ms/sample':>23}{'tokens records/sample':>23}")
    for i, r in enumerate(rows):
        print(f"{i:<7}{args.interval if r['mode'] == 'on' else 1:>9}{r['samples']:>9}{r['seconds']:>9.2f}"
              f"{r['samples_per_s']:>11.1f}{r['cpu_ms_per_sample']:>21.3f}{r['machine_cpu_ms_per_sample']:>23.3f}"
              f"{r['records_per_sample']:>23.1f}")
    # bracketed() gives 1 - N/1 for throughput and N/1 - 1 for costs: turn both into N/1 ratios
    speedup = [1 - x for x in bracketed(rows, "samples_per_s", higher_is_better=True)]
    stage_cpu = [1 + x for x in bracketed(rows, "cpu_ms_per_sample", higher_is_better=False)]
    machine_cpu = [1 + x for x in bracketed(rows, "machine_cpu_ms_per_sample", higher_is_better=False)]
    out: dict[str, Any] = {
        "interval": args.interval, "rounds": args.rounds, "samples_per_phase": rows[0]["samples"],
        "speedup": round(float(np.mean(speedup)), 4), "speedup_ci95": ci95(speedup),
        "stage_cpu_ratio": round(float(np.mean(stage_cpu)), 4), "stage_cpu_ratio_ci95": ci95(stage_cpu),
        "machine_cpu_ratio": round(float(np.mean(machine_cpu)), 4), "machine_cpu_ratio_ci95": ci95(machine_cpu),
        "samples_per_s_interval_1": round(float(np.median([r["samples_per_s"] for r in rows if r["mode"] == "off"])), 1),
        "samples_per_s_interval_n": round(float(np.median([r["samples_per_s"] for r in rows if r["mode"] == "on"])), 1),
        "records_per_sample_interval_1": round(float(np.median([r["records_per_sample"] for r in rows
                                                                 if r["mode"] == "off"])), 2),
        "records_per_sample_interval_n": round(float(np.median([r["records_per_sample"] for r in rows
                                                                 if r["mode"] == "on"])), 2),
    }
    print(f"\n{'interval ' + str(args.interval) + ' vs 1 (its neighbours)':<34}{'mean':>8}{'95% CI of mean':>20}")
    for name, values in (("throughput (x)", speedup), ("stage CPU per sample (x)", stage_cpu),
                         ("machine CPU per sample (x)", machine_cpu)):
        ci = ci95(values)
        print(f"{name:<34}{np.mean(values):>8.3f}{'-' if ci is None else f'{ci[0]:.3f}..{ci[1]:.3f}':>20}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=int, default=8, help="the stream interval compared with 1 (default 8)")
    p.add_argument("--quick", action="store_true", help="shorter phases: a smoke run")
    p.add_argument("--rounds", type=int, default=4, help="interval-N phases, each between two interval-1 phases")
    p.add_argument("--phase-samples", type=int, help="samples per phase (default: the pipeline stage's)")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    p.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"))
    p.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL"))
    args = p.parse_args()
    if args.interval < 2:
        p.error(f"--interval must be >= 2 (it is compared with 1), got {args.interval}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.phase_samples is not None and args.phase_samples < 60:
        p.error(f"--phase-samples must be >= 60, got {args.phase_samples}")
    out = anyio.run(main_async, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
