"""The learner role: experience from the event log in, weights into the control store and checkpoints out.

``LearnerActor`` wraps the infrastructure-free ``Learner`` (``learning/core.py``):

- One learner per deployment. It reads *every* partition of ``rollout.experience`` by manual
  assignment, starting at the offsets of its latest checkpoint (or the beginning); consumer-group
  commits are not used: the checkpoint is the only record of what was consumed.
- Each optimizer step is followed, in this order, by: a weight publication when the step closes a
  ``publish_every`` interval (safetensors into the object store, then the manifest into KV), a
  checkpoint every ``checkpoint_every`` steps, and the status JSON under ``Names.LEARNER_VERSION_KEY``.
  Publishing before checkpointing means a checkpoint's version has always been announced.
- On start the learner re-announces its weights when the KV holds no manifest or an older one; if
  the KV holds a *newer* version (published after the checkpoint by a life that then crashed), it
  republishes its checkpointed weights as ``latest + 1``: versions never repeat or go backwards.
- ``max_steps`` ends ``serve()``; so does a drain. Both write a final checkpoint; records read but not
  folded into a step stay unconsumed and are read again by the next life.
- Audit log: ``<checkpoint_dir>/<namespace>/audit.jsonl`` gets one ``start`` line per life (the step it
  resumed at) and, per step, one line per folded sample (``sample_id``, ``verdict``, ``step``,
  ``version``), flushed before that step's publication and checkpoint. A life's lines past its last
  checkpoint are superseded by the next life's ``start`` line (``ops/ledger.py`` rebuilds the lineage).
- Step log: ``<checkpoint_dir>/<namespace>/steps.jsonl`` gets one line per step: ``step``, ``t`` (seconds
  since this learner actor was made), ``wall`` (Unix time), ``version``, ``trained``, ``reward_trained``
  (mean reward of the trained samples), ``reward_all`` (mean reward of every sample folded into the step,
  trained and filtered: what a synchronous loop would call its batch reward), the step's metrics and
  ``domains``: per domain of the trained batch, samples, tokens, reward, adv_abs, loss_weight, grad_share
  (``learning.core.domain_report``; also the actor's ``step_domains`` statistic).
- ``learner.simulate``: the step only waits a SIMULATED time and publications wait a simulated transfer
  time (``actors/learner_sim.py``); the tiny built-in model is what is checkpointed and published, and the
  status, step lines and logs say ``simulated``.
- ``learner.export_dir``: when set, the final weights (model and tokenizer) are saved there as a Hugging
  Face directory when the learner stops (drain or ``max_steps``), after the final checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import uuid
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import ctypes
import ctypes.util

import anyio
import torch
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from actors import tracing
from actors.learner_checkpoint import CheckpointStore
from learning import canary
from learning.core import Learner, StepReport, Verdict, score_tokens
from modelserver.client import SGLangClient, SGLangError, SGLangHTTPError, SGLangProtocolError
from modelserver.llm import build_char_tokenizer, build_tiny_model, load_model_dir, save_model_dir, tiny_config
from actors.runtime import Runtime
from engine.actor import Actor
from engine.config import LearnerConfig
from engine.schemas import Experience
from engine.topics import Names
from streams.protocols import AssignedConsumer
from streams.weights import WeightPublisher

log = logging.getLogger("rollout.learner")

StepHook = Callable[[StepReport], None]

AUDIT_LOG = "audit.jsonl"
"""File, in the learner's checkpoint directory, of the per-step sample audit (see the module docstring)."""
STEP_LOG = "steps.jsonl"
"""File, in the learner's checkpoint directory, of one JSON line per step (see the module docstring)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Offered:
    """A record folded into the next step, as its trace sees it."""

    traceparent: str | None
    sample_id: str
    verdict: Verdict
    at_ns: int
    reward: float


def save_weights(model: PreTrainedModel, out_dir: Path, dtype: str = "float32",
                 tokenizer: PreTrainedTokenizerBase | None = None) -> list[str | Path]:
    """Write ``model`` (and ``tokenizer``: a publication is a whole HF directory) for publication, floating
    tensors in ``dtype``.

    Tensors that share storage (tied embeddings) are converted once and stay shared, so
    ``save_pretrained`` still writes them once. Returns the files written, sorted.
    """
    wire = getattr(torch, dtype)
    if all(p.dtype == wire for p in model.state_dict().values() if p.is_floating_point()):
        model.save_pretrained(out_dir, safe_serialization=True)
    else:
        converted: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
        state = {}
        for name, t in model.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in converted:
                converted[key] = t.detach().to(wire) if t.is_floating_point() else t
            state[name] = converted[key]
        model.save_pretrained(out_dir, safe_serialization=True, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return sorted(p for p in out_dir.iterdir() if p.is_file())


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; a no-op elsewhere).

    A step allocates and frees gigabytes of activations and a publication a model-sized copy, from
    worker threads that each get their own malloc arena; freed, that memory stays in the arenas (a
    daemon training SmolLM2-135M held ~8 GB after 8 steps and ~12 GB after 26 without this).
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_libc_name = ctypes.util.find_library("c")
try:
    _LIBC = ctypes.CDLL(_libc_name) if _libc_name else None
    if _LIBC is not None and not hasattr(_LIBC, "malloc_trim"):
        _LIBC = None
except OSError:
    _LIBC = None


class LearnerActor(Actor):
    """Consumes experience, trains, publishes weights, checkpoints; see the module docstring."""

    role: ClassVar[str] = "learner"

    def __init__(self, rt: Runtime, model_dir: str | None = None, *, name: str | None = None,
                 on_step: StepHook | None = None, probe_urls: list[str] | None = None) -> None:
        super().__init__(name)
        self.rt = rt
        self.cfg = rt.cfg.learner
        self.model_dir = model_dir or rt.cfg.inference.model_dir
        self.on_step = on_step
        self.store = CheckpointStore(Path(self.cfg.checkpoint_dir) / rt.cfg.namespace)
        self.learner: Learner | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.consumer: AssignedConsumer | None = None
        self.publisher: WeightPublisher | None = None
        self.resumed_from: Path | None = None
        self.last_checkpoint: Path | None = None
        self.published_version: int | None = None
        self.last_metrics: dict[str, float] = {}
        self._offered: list[_Offered] = []
        self._status_never_trained = 0
        self.audit_path = self.store.root / AUDIT_LOG
        self.steps_path = self.store.root / STEP_LOG
        self._life = uuid.uuid4().hex[:12]
        self._last_step_end = time.monotonic()
        self._made = time.monotonic()
        # the weights canary (learning/canary.py): which servers, when due, what it found
        self.probe_urls = list(probe_urls if probe_urls is not None else rt.cfg.inference.urls)
        self._published_at: dict[int, float] = {}
        self._canary_due = False
        self._canary_next = 0.0
        self.canary_checks = 0
        self.canary_trips = 0
        self.canary_gap: float | None = None
        self.canary_tripped: str | None = None
        self.weights_check = WeightsCheck(self.cfg, rt.cfg.inference.dtype)
        """The canary's exact check against bf16 servers (expected values, servers that cannot answer)."""
        self._canary_clients: dict[str, SGLangClient] = {}
        """One client per probed server for this life: it remembers, say, a server without ``/get_weight_version``."""

    # -- lifecycle ---------------------------------------------------------------------------------
    async def setup(self) -> None:
        if self.rt.cfg.learner.torch_threads:
            torch.set_num_threads(self.rt.cfg.learner.torch_threads)
        self.learner, self.tokenizer = await anyio.to_thread.run_sync(self._load)
        assert self.learner is not None
        if self.cfg.simulate is not None:
            from actors.learner_sim import describe

            log.warning("%s: SIMULATED learner (no training): %s", self.name, describe(self.cfg.simulate))
        if self.cfg.canary_every and self.probe_urls and self.cfg.simulate is None and self.weights_check.active:
            # learner.canary_weights against this model: a name it lacks stops the start (ValueError names it)
            await anyio.to_thread.run_sync(self.weights_check.plan, self.learner)
        self._audit([{"event": "start", "life": self._life, "step": self.learner.step_count,
                      "version": self.learner.version,
                      "resumed_from": self.resumed_from.name if self.resumed_from else None}])
        self.publisher = WeightPublisher(self.rt.require_control(), self.rt.names, producer=self.name)
        self.consumer = await self.rt.assigned_consumer(
            "learner", topics=[self.rt.names.experience], start_offsets=dict(self.learner.offsets),
            expect=(Experience.SCHEMA,)).start()
        await self._announce_on_start()
        await self._put_status()

    async def serve(self) -> None:
        assert self.learner is not None and self.consumer is not None
        learner = self.learner
        while not self.draining and not self._reached_max_steps():
            records = await self.consumer.getmany(timeout_s=0.2, max_records=4 * self.cfg.batch_size)
            for record in records:
                if self._reached_max_steps():
                    break  # records past the last step stay unconsumed for the next life
                exp = record.message
                assert isinstance(exp, Experience)  # the consumer dead-letters every other schema
                verdict = learner.offer(exp, (record.topic, record.partition), record.offset)
                self._offered.append(_Offered(record.traceparent, exp.sample_id, verdict, time.time_ns(),
                                              float(exp.reward)))
                record.ack()
                if learner.ready:
                    await self._step()
            if self._canary_due and time.monotonic() >= self._canary_next:
                await self._canary()
            if learner.never_trained != self._status_never_trained:
                await self._put_status()  # admission control counts pending filtered samples too
        await self._checkpoint()
        if self.cfg.export_dir:
            await anyio.to_thread.run_sync(self._export, Path(self.cfg.export_dir))

    async def teardown(self) -> None:
        clients, self._canary_clients = self._canary_clients, {}
        for client in clients.values():
            await client.aclose()
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            await consumer.close()

    # -- one step and what follows it ---------------------------------------------------------------
    async def _step(self) -> None:
        """One optimizer step, its publication/checkpoint/status, under a ``learner.step`` span.

        The step consumes samples of many rollouts, so its span is the root of its own trace, linked to
        each sample's context; each sample's trace gets a ``learner.consume`` child span in turn.
        """
        assert self.learner is not None
        offered, self._offered = self._offered, []
        with tracing.tracer().start_as_current_span("learner.step", context=Context(), kind=SpanKind.INTERNAL) as span:
            started = time.monotonic()
            try:
                report = await anyio.to_thread.run_sync(self.learner.step)
            except BaseException:
                self._offered = offered + self._offered  # still pending in the learner
                raise
            # where the learner's time goes: waiting for a batch, the optimizer step, the publication
            report.metrics.update(wait_s=round(started - self._last_step_end, 3),
                                  train_s=round(time.monotonic() - started, 3))
            self.last_metrics = report.metrics
            await anyio.to_thread.run_sync(self._audit_step, report)
            if report.publish:
                published = time.monotonic()
                await self._publish()
                report.metrics["publish_s"] = round(time.monotonic() - published, 3)
            await anyio.to_thread.run_sync(self._log_step, report, offered)
            if report.step % self.cfg.checkpoint_every == 0:
                await self._checkpoint()
            await self._put_status()
            await anyio.to_thread.run_sync(release_free_memory)
            self._last_step_end = time.monotonic()
            if span.is_recording():
                self._trace_step(span, report, offered)
        loss = report.metrics.get("loss")
        stale_trained = round(report.metrics.get("stale_trained_frac", 0.0) * len(report.trained))
        log.info("%s: %sstep %d (judged at v%d): trained %d (%d stale, downweighted), stale-dropped %d, filtered %d, "
                 "dup %d, loss %s",
                 self.name, "SIMULATED " if self.cfg.simulate else "", report.step, report.version, len(report.trained),
                 stale_trained, len(report.dropped_stale), len(report.filtered), report.duplicates,
                 f"{loss:.4f}" if isinstance(loss, (int, float)) else "none (no gradient step)")
        m = report.metrics
        if isinstance(m.get("mismatch_max"), float):  # train/serve mismatch, same-version tokens only
            log.info("%s: step %d same-version mismatch |learner - server| p50 %.2e p99 %.2e max %.2e over %d tokens",
                     self.name, report.step, m["mismatch_p50"], m["mismatch_p99"], m["mismatch_max"],
                     int(m["mismatch_tokens"]))
        if self.on_step is not None:
            self.on_step(report)

    def _trace_step(self, span: Span, report: StepReport, offered: list[_Offered]) -> None:
        """Link the step to its samples' traces and end a ``learner.consume`` span in each of them."""
        span.set_attributes({"rollout.role": self.role, "rollout.step": report.step,
                             "rollout.judged_version": report.version, "rollout.trained": len(report.trained),
                             "rollout.dropped_stale": len(report.dropped_stale),
                             "rollout.filtered": len(report.filtered), "rollout.duplicates": report.duplicates,
                             "rollout.published": report.publish, "rollout.consumed": len(offered),
                             **{f"rollout.metrics.{k}": float(v) for k, v in report.metrics.items()}})
        step_link = [Link(span.get_span_context())]
        tracer = tracing.tracer()
        for o in offered:
            parent = tracing.span_context_of(o.traceparent)
            if parent is None:
                continue
            span.add_link(parent, {"rollout.sample_id": o.sample_id, "rollout.verdict": o.verdict})
            consume = tracer.start_span("learner.consume", context=tracing.context_of(o.traceparent),
                                        kind=SpanKind.CONSUMER, links=step_link, start_time=o.at_ns)
            consume.set_attributes({"rollout.role": self.role, "rollout.sample_id": o.sample_id,
                                    "rollout.verdict": o.verdict, "rollout.step": report.step,
                                    "rollout.judged_version": report.version})
            consume.end()

    def _audit_step(self, report: StepReport) -> None:
        rows = [{"life": self._life, "step": report.step, "version": report.version, "sample_id": sid,
                 "verdict": verdict}
                for verdict, ids in (("train", report.trained), ("dropped_stale", report.dropped_stale),
                                     ("filtered", report.filtered)) for sid in ids]
        rows.append({"event": "step", "life": self._life, "step": report.step, "version": report.version,
                     "samples": len(rows), "duplicates": report.duplicates})
        self._audit(rows)

    def _log_step(self, report: StepReport, offered: list[_Offered]) -> None:
        """Append the step's line to ``steps.jsonl`` (see the module docstring)."""
        trained = [o.reward for o in offered if o.verdict == "train"]
        folded = [o.reward for o in offered if o.verdict in ("train", "filtered")]
        row: dict[str, Any] = {"step": report.step, "t": round(time.monotonic() - self._made, 3),
                               "wall": round(time.time(), 3),
                               "version": report.version, "trained": len(report.trained),
                               "reward_trained": sum(trained) / len(trained) if trained else None,
                               "reward_all": sum(folded) / len(folded) if folded else None, **report.metrics}
        if report.domains:
            row["domains"] = {d: {k: round(v, 6) for k, v in figures.items()} for d, figures in report.domains.items()}
        self.steps_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.steps_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _export(self, out: Path) -> None:
        """Save the final weights and tokenizer as a Hugging Face directory at ``out`` (replaced whole)."""
        assert self.learner is not None and self.tokenizer is not None
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model_dir(self.learner.model, self.tokenizer, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        log.info("%s: exported step %d (version %d) to %s", self.name, self.learner.step_count,
                 self.learner.version, out)

    def _audit(self, rows: list[dict[str, Any]]) -> None:
        """Append ``rows`` to the audit log, durably (before the step's checkpoint can exist)."""
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.audit_path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())

    async def _publish(self) -> None:
        assert self.learner is not None and self.publisher is not None
        learner, tokenizer = self.learner, self.tokenizer
        assert tokenizer is not None
        if self.cfg.simulate is not None:
            from actors.learner_sim import publish_seconds

            # SIMULATED: the stated model's bytes over the stated bandwidth, before the (tiny) real publication
            await anyio.sleep(publish_seconds(self.cfg.simulate) * self.cfg.simulate.time_scale)
        with tempfile.TemporaryDirectory(prefix="rollout-weights-") as tmp:
            # the whole HF directory (config, safetensors, tokenizer): what SGLang's /update_weights_from_disk
            # and a fresh `--model-path` load (streams/weights.py: check_hf_dir); tensors in learner.publish_dtype
            files = await anyio.to_thread.run_sync(lambda: self._save_pretrained(tmp, tokenizer))
            await self.publisher.publish(learner.version, files, step=learner.step_count)
        self.published_version = learner.version
        self._published_at[learner.version] = time.monotonic()
        every = self.cfg.canary_every
        # a simulated learner's tiny model is not the served one: nothing to compare
        if every and self.probe_urls and self.cfg.simulate is None and learner.version % every == 0:
            self._canary_due = True

    async def _checkpoint(self) -> None:
        assert self.learner is not None and self.tokenizer is not None
        learner, tokenizer = self.learner, self.tokenizer
        self.last_checkpoint = await anyio.to_thread.run_sync(lambda: self._save_checkpoint(learner, tokenizer))

    def _save_pretrained(self, path: str, tokenizer: PreTrainedTokenizerBase) -> list[str | Path]:
        assert self.learner is not None
        with self.learner.export_model() as model:  # LoRA adapters merged into the published weights
            return save_weights(model, Path(path), self.cfg.publish_dtype, tokenizer)

    def _save_checkpoint(self, learner: Learner, tokenizer: PreTrainedTokenizerBase) -> Path:
        with learner.export_model() as model:
            return self.store.save(model, tokenizer, learner.optimizer_state(), learner.progress())

    async def _put_status(self) -> None:
        assert self.learner is not None
        ledger = self.learner.ledger
        status: dict[str, Any] = {"version": self.learner.version, "step": self.learner.step_count, "consumed": ledger.consumed,
                  "trained": ledger.trained, "dropped_stale": ledger.dropped_stale, "filtered": ledger.filtered,
                  "never_trained": self.learner.never_trained}
        if self.cfg.simulate is not None:
            status["simulated"] = True
        if self.canary_checks or self.canary_tripped:
            status["canary"] = {"checks": self.canary_checks, "trips": self.canary_trips, "gap": self.canary_gap,
                                "tripped": self.canary_tripped}
        self._status_never_trained = self.learner.never_trained
        await self.rt.require_control().kv_put(self.rt.kv_bucket, Names.LEARNER_VERSION_KEY, json.dumps(status).encode())

    async def _announce_on_start(self) -> None:
        assert self.learner is not None and self.publisher is not None
        latest = await self.publisher.latest()
        if latest is not None and latest.version == self.learner.version:
            self.published_version = latest.version
            return
        if latest is not None and latest.version > self.learner.version:
            log.warning("%s: KV announces weight version %d, newer than the checkpoint's %d (a lost life); "
                        "republishing the checkpointed weights as version %d", self.name, latest.version,
                        self.learner.version, latest.version + 1)
            self.learner.version = latest.version + 1
        await self._publish()

    # -- loading -----------------------------------------------------------------------------------
    def _load(self) -> tuple[Learner, PreTrainedTokenizerBase]:
        self.store.remove_partial()
        latest = self.store.latest()
        max_staleness = self.rt.cfg.scheduler.max_staleness
        if latest is not None:
            ckpt = self.store.load(latest)
            # The KL reference is the initial weights, not the checkpoint's (with LoRA: the base model).
            reference = self._initial_model()[0] if self.cfg.kl_coef > 0 and not self.cfg.lora_rank else None
            learner = self._make_learner(ckpt.model, ckpt.tokenizer, max_staleness, reference)
            learner.load_optimizer_state(ckpt.optimizer)
            learner.restore_progress(ckpt.progress)
            self.resumed_from = latest
            log.info("%s: resumed from %s (step %d, version %d)", self.name, latest, learner.step_count,
                     learner.version)
            return learner, ckpt.tokenizer
        model, tokenizer = self._initial_model()
        return self._make_learner(model, tokenizer, max_staleness), tokenizer

    def _initial_model(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if self.model_dir is not None and self.cfg.simulate is None:
            return load_model_dir(self.model_dir)
        tokenizer = build_char_tokenizer()
        return build_tiny_model(tiny_config(len(tokenizer)), seed=self.cfg.seed), tokenizer

    def _make_learner(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_staleness: int,
                      reference: PreTrainedModel | None = None) -> Learner:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if self.cfg.simulate is not None:
            from actors.learner_sim import SimulatedLearner

            return SimulatedLearner(model, self.cfg, max_staleness=max_staleness, pad_id=pad)
        return Learner(model, self.cfg, max_staleness=max_staleness, pad_id=pad, reference=reference)

    # -- the weights canary ---------------------------------------------------------------------------
    async def _canary(self) -> None:
        """Probe every server (between steps: the weights hold still); a trip is loud and, by config, fatal."""
        assert self.learner is not None and self.tokenizer is not None
        self._canary_next = time.monotonic() + 1.0  # a lagging server is probed again, once a second
        verdicts = []
        for url in self.probe_urls:
            if url not in self._canary_clients:
                self._canary_clients[url] = SGLangClient([url], timeout=self.rt.cfg.inference.request_timeout_s,
                                                         api_key=self.rt.cfg.inference.resolved_api_key())
            try:
                verdicts.append(await probe_server(url, self.learner, self.tokenizer, self.cfg, self._published_at,
                                                   serving_dtype=self.rt.cfg.inference.dtype,
                                                   weights_check=self.weights_check,
                                                   client=self._canary_clients[url]))
            except (SGLangError, OSError) as exc:
                log.warning("%s: canary could not probe %s: %s", self.name, url, exc)
                return  # an unreachable server is the supervisor's business; probe again later
        # done once every server was compared at the learner's version (or tripped); a lagging one is probed again
        self._canary_due = any(v.ok and not v.compared for v in verdicts)
        for v in verdicts:
            self.canary_checks += 1
            if v.gap is not None:
                self.canary_gap = v.gap
                self.last_metrics["canary_gap"] = v.gap
            if v.ok:
                log.debug("%s: canary: %s", self.name, v.reason)
                continue
            self.canary_trips += 1
            self.canary_tripped = v.reason
            log.error("%s: CANARY TRIPPED: %s", self.name, v.reason)
            await self._put_status()
            if self.cfg.canary_action == "stop":
                raise CanaryTripped(v.reason)

    def _reached_max_steps(self) -> bool:
        return (self.cfg.max_steps is not None and self.learner is not None
                and self.learner.step_count >= self.cfg.max_steps)

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        if self.learner is not None:
            stats.update(self.learner.statistics())
        stats.update(canary_checks=self.canary_checks, canary_trips=self.canary_trips, canary_gap=self.canary_gap,
                     canary_tripped=self.canary_tripped,
                     **{k: self.last_metrics[k] for k in ("mismatch_p50", "mismatch_p99", "mismatch_max")
                        if k in self.last_metrics})
        stats.update(published_version=self.published_version, metrics=dict(self.last_metrics),
                     step_domains=dict(self.learner.last_domains) if self.learner is not None else {},
                     checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
                     resumed_from=str(self.resumed_from) if self.resumed_from else None)
        if self.consumer is not None:
            stats["consumer"] = self.consumer.statistics()
        return stats


class CanaryTripped(RuntimeError):
    """The weights canary found a server not serving what it claims (``learner.canary_action = "stop"``)."""


class WeightsCheck:
    """The learner's side of the canary's exact check against bf16 servers (``learning/canary.py``,
    :func:`~learning.canary.judge_weights`): which parameters to ask for and how many rows
    (``learner.canary_weights``), the learner's values as the servers should hold them (computed once per
    weight version, for every server), and the servers that cannot answer ``/get_weights_by_name``.

    A server answering 404 or 405 (no such endpoint) or 400 (SGLang's answer when its model class cannot
    look the name up) is remembered, said once at warning level, and probed by log-probs from then on.
    """

    UNAVAILABLE = (400, 404, 405)
    """Statuses that make the exact check unavailable on a server (see the class docstring)."""

    def __init__(self, cfg: LearnerConfig, serving_dtype: str) -> None:
        self.cfg = cfg
        self.serving_dtype = serving_dtype
        self.unavailable: set[str] = set()
        """Servers that cannot answer; the log-prob probe is used there."""
        self._expected: tuple[tuple[int, int], dict[str, tuple[int, list[Any]]]] | None = None

    @property
    def active(self) -> bool:
        """Only bf16 servers are checked this way; fp32 servers keep the log-prob probe (1e-3 catches a missed
        update there)."""
        return self.serving_dtype == "bf16"

    def _plan(self, model: PreTrainedModel, state: dict[str, torch.Tensor]) -> dict[str, int]:
        names = self.cfg.canary_weights or canary.default_weight_names(int(model.config.num_hidden_layers))
        return canary.weight_plan(names, {name: tuple(t.shape) for name, t in state.items()})

    def plan(self, learner: Learner) -> dict[str, int]:
        """``name -> truncate_size`` (``canary.weight_plan``); ``ValueError`` for a name the model lacks.
        Runs in a worker thread (with LoRA the adapters are merged: the published names are read)."""
        with learner.export_model() as model:
            return self._plan(model, model.state_dict())

    def expected(self, learner: Learner) -> dict[str, tuple[int, list[Any]]]:
        """``name -> (truncate_size, values)``: the learner's published weights as a server holds them (fp32 ->
        ``learner.publish_dtype`` -> the serving dtype). Worker thread; cached for the weights held now."""
        held = (learner.version, learner.step_count)
        if self._expected is not None and self._expected[0] == held:
            return self._expected[1]
        with learner.export_model() as model:  # LoRA adapters merged, as in the publication
            state = model.state_dict()
            values = {name: (rows, canary.served_values(state[name], rows, self.cfg.publish_dtype, self.serving_dtype))
                      for name, rows in self._plan(model, state).items()}
        self._expected = (held, values)
        return values

    async def compare(self, client: SGLangClient, url: str, claimed: int, learner: Learner) -> canary.Verdict | None:
        """The exact check of ``url`` (which claims the learner's version, held unchanged since its
        publication); None when the server cannot answer (then the caller probes log-probs)."""
        expected = await anyio.to_thread.run_sync(self.expected, learner)
        served: dict[str, Any] = {}
        for name, (rows, _) in expected.items():
            try:
                served[name] = await client.get_weights_by_name(name, rows, url=url)
            except (SGLangHTTPError, SGLangProtocolError) as exc:
                if exc.status not in self.UNAVAILABLE:
                    raise
                self.unavailable.add(url)
                log.warning("canary: %s cannot answer /get_weights_by_name (%s); the exact weights check against "
                            "this bf16 server is unavailable, its probe log-probs are compared instead (threshold "
                            "%g: gross failures only, not one missed update)", url, exc,
                            canary.effective_threshold(self.cfg.canary_threshold, self.serving_dtype))
                return None
        return canary.judge_weights(url=url, claimed=claimed, expected={n: v for n, (_, v) in expected.items()},
                                    served=served, cast=f"float32 -> {self.cfg.publish_dtype} -> {self.serving_dtype}")


def _claimed_version(url: str, reported: str | None) -> int | canary.Verdict:
    """The weight version ``url`` reports, as an integer; a failed verdict when it is not one."""
    try:
        return int(reported or "")
    except ValueError:
        return canary.Verdict(False, f"server {url} reports no integer weight version ({reported!r})")


async def probe_server(url: str, learner: Learner, tokenizer: PreTrainedTokenizerBase, cfg: LearnerConfig,
                       published_at: dict[int, float], *, api_key: str | None = None,
                       timeout_s: float = 60.0, serving_dtype: str = "fp32",
                       weights_check: WeightsCheck | None = None,
                       client: SGLangClient | None = None) -> canary.Verdict:
    """One canary probe of the server at ``url`` (``learning/canary.py``). A bf16 server that can answer
    ``/get_weights_by_name`` is asked the version it serves (``/get_weight_version``) and, at the learner's
    version (no step since its publication), its weights are compared exactly (:class:`WeightsCheck`;
    ``weights_check`` keeps what it learned between probes): nothing is generated. Any other server generates
    a fixed prompt at temperature 1, and its probe log-probs at the version it claims are compared with the
    learner's own. ``client`` (the caller's, for ``url`` alone, kept open between probes so that what it learns
    about the server lasts, such as an upstream SGLang without ``/get_weight_version``) is used where given;
    otherwise one is made for this probe from ``api_key`` and ``timeout_s``."""
    check = weights_check if weights_check is not None else WeightsCheck(cfg, serving_dtype)
    own = client is None
    if client is None:
        client = SGLangClient([url], timeout=timeout_s, api_key=api_key)
    try:
        if check.active and url not in check.unavailable:
            claimed = _claimed_version(url, await client.get_weight_version(url))
            if isinstance(claimed, canary.Verdict):
                return claimed
            if claimed == learner.version and learner.serves_own_version:
                verdict = await check.compare(client, url, claimed, learner)
                if verdict is not None:
                    return verdict
        prompt = list(tokenizer.encode(canary.PROBE_TEXT, add_special_tokens=False))
        result = await client.generate(prompt, sampling_params={"max_new_tokens": canary.PROBE_TOKENS,
                                                                "temperature": 1.0, "sampling_seed": 0},
                                       rid=f"canary-{uuid.uuid4().hex[:8]}")
    finally:
        if own:
            await client.aclose()
    claimed = _claimed_version(url, result.weight_version)
    if isinstance(claimed, canary.Verdict):
        return claimed
    comparable = claimed == learner.version and learner.serves_own_version
    ours = (await anyio.to_thread.run_sync(score_tokens, learner.model, prompt, list(result.output_ids), 1.0)
            if comparable else None)
    since = published_at.get(claimed + 1)
    return canary.judge(url=url, claimed=claimed, learner_version=learner.version, comparable=comparable,
                        server_logprobs=list(result.logprobs or []), learner_logprobs=ours,
                        threshold=canary.effective_threshold(cfg.canary_threshold, serving_dtype),
                        lag_s=None if since is None else time.monotonic() - since,
                        max_lag_s=cfg.canary_max_lag_s)
