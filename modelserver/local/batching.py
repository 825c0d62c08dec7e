"""What every engine behind the local server shares: sequences, the queue, aborts, pauses, the scheduler's loop.

:class:`BatchingEngine` holds the waiting queue and the running list, ``submit`` / ``abort`` /
``pause`` / ``continue_`` as SGLang's HTTP API has them, the scheduler task's lifecycle and the step
counters. A subclass says what one step does (``_step``), what a sequence gets when it is submitted
(``_prepare``) and what it gives back when it leaves (``_release``): the local engine
(``local/engine.py``: a model and a KV store) and the simulated one (``sim/engine.py``: roofline time,
synthetic tokens) are the two.

Aborts of running sequences are marked and applied between steps (a step may be running in a worker
thread); waiting ones finish at once. Pauses and weight updates take the step lock.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from modelserver.local.protocol import BadRequest, SamplingParams

__all__ = ["BatchingEngine", "EngineStatistics", "PauseMode", "Sequence", "abort_reason"]

PauseMode = Literal["abort", "retract", "in_place"]


@dataclass(eq=False)
class Sequence:
    """One generation: its prompt, outputs so far, KV cache and finish state."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs_num: int = 0
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    token_versions: list[str] = field(default_factory=list)
    kv_id: int | None = None
    """The KV store's id of this sequence's cache while it runs (a block table of the paged store, a row
    of the slot store); None while it waits."""
    cached: int = 0
    """Tokens of prompt + output whose keys and values are in its KV cache."""
    cached_tokens: int = 0
    """Prompt tokens copied from another sequence's cache or the prefix cache (SGLang's ``cached_tokens``)."""
    kv_epoch: int = -1
    """The KV store's weights epoch when this sequence's KV cache was filled (its KV is valid under it only)."""
    finish_reason: dict[str, Any] | None = None
    finished_at: float | None = None
    weight_version: str = "default"
    stop_trim_chars: int | None = None  # text length to keep when a stop string matched
    abort_message: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    generator: torch.Generator | None = None
    _stop_scan_from: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached_len(self) -> int:
        return self.cached

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def pending_ids(self) -> list[int]:
        """Tokens of prompt + output not yet in the KV cache."""
        cached = self.cached_len
        n_prompt = len(self.prompt_ids)
        if cached >= n_prompt:
            return self.output_ids[cached - n_prompt :]
        return self.prompt_ids[cached:] + self.output_ids

    async def wait_changed(self) -> None:
        """Wait until new output or a finish is published, then re-arm."""
        await self.changed.wait()
        self.changed.clear()


@dataclass(frozen=True)
class EngineStatistics:
    """An immutable snapshot of the engine's counters."""

    running: int
    waiting: int
    paused: bool
    weight_version: str
    steps: int
    decode_tokens: int
    prefill_tokens: int
    finished: int
    kv_bytes_per_token: int = 0
    """KV cache bytes per cached token in the serving dtype (keys + values, every layer)."""
    kv_slot_bytes: int = 0
    """Bytes the KV store has allocated (the paged pool, or the slot tensors)."""
    kv_cache: str = "paged"
    kv_block_size: int = 0
    """Tokens per block of the paged pool (0: the slot store)."""
    kv_blocks_total: int = 0
    """The paged pool's bound in blocks (``kv_cache_tokens // kv_block_size``)."""
    kv_blocks_used: int = 0
    """Blocks held by running sequences and the prefix tree."""
    kv_waiting_for_blocks: int = 0
    """Requests queued because the pool cannot hold their worst case yet (admission control)."""
    prefix_cache_tokens: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_max_tokens: int = 0
    prefix_cache_lookups: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    """Prompt tokens served from the retained prefix cache (not computed)."""
    shared_prefix_tokens: int = 0
    """Prompt tokens copied from running sequences (a group's samples)."""
    prefix_cache_evicted_tokens: int = 0
    prefix_cache_flushes: int = 0
    prefix_cache_int8_tokens: int = 0
    """Tokens held in the int8 tier (evicted from the hot tier, quantised)."""
    prefix_cache_int8_bytes: int = 0
    prefix_cache_int8_max_tokens: int = 0
    prefix_cache_int8_hits: int = 0
    prefix_cache_int8_hit_tokens: int = 0
    prefix_cache_disk_tokens: int = 0
    """Tokens held in the disk tier (evicted from the int8 tier, still int8, one file each)."""
    prefix_cache_disk_bytes: int = 0
    prefix_cache_disk_max_tokens: int = 0
    prefix_cache_disk_hits: int = 0
    prefix_cache_disk_hit_tokens: int = 0


def abort_reason(message: str) -> dict[str, Any]:
    """An aborted sequence's ``finish_reason``, as SGLang writes it."""
    return {"type": "abort", "message": message, "status_code": 200, "err_type": None}


class BatchingEngine:
    """The queue, aborts, pauses and scheduler loop of a continuous-batching engine; see the module docstring.

    All public methods run on the event loop.
    """

    task_name = "engine-scheduler"

    def __init__(self, *, max_batch: int, weight_version: str, context_length: int) -> None:
        self.max_batch = max_batch
        self.weight_version = weight_version
        self.context_length = context_length
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._paused = False
        self._stepping = False  # a step is running (in a worker thread): aborts wait for its end
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._steps = self._decode_tokens = self._prefill_tokens = self._finished = 0

    # ---------------------------------------------------------------- what a subclass says

    async def _step(self) -> None:
        """One step over the running sequences (under the step lock, not paused)."""
        raise NotImplementedError

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`BadRequest` for a request this engine can never serve (beyond the context length)."""

    def _prepare(self, seq: Sequence) -> None:
        """What a new sequence gets before it is queued (a seeded generator, a simulated length)."""

    def _release(self, seq: Sequence) -> None:
        """Give back what a sequence holds (it finished, or is retracted to be re-prefilled later)."""
        seq.kv_id = None
        seq.cached = 0

    def _on_close(self) -> None:
        """Free what the engine holds once the scheduler has stopped."""

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the scheduler task (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._scheduler(), name=self.task_name)

    async def aclose(self) -> None:
        """Abort everything and stop the scheduler (idempotent)."""
        self._closed = True
        self.abort_all("server shutting down")
        self._wake.set()
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._on_close()

    @property
    def paused(self) -> bool:
        return self._paused

    def _counters(self) -> dict[str, Any]:
        """The ``EngineStatistics`` fields every engine has."""
        return dict(running=len(self._running), waiting=len(self._waiting), paused=self._paused,
                    weight_version=self.weight_version, steps=self._steps, decode_tokens=self._decode_tokens,
                    prefill_tokens=self._prefill_tokens, finished=self._finished)

    def flush_cache(self) -> bool:
        """``/flush_cache``: refused (False) while requests run or wait, as SGLang does."""
        return not (self._running or self._waiting)

    # ---------------------------------------------------------------- requests

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, rid: str | None = None, top_logprobs_num: int = 0) -> Sequence:
        """Queue a generation and return its :class:`Sequence` (watch it with ``wait_changed``)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if len(prompt_ids) >= self.context_length:
            raise BadRequest(
                f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        self._check_request(prompt_ids, params)
        seq = Sequence(
            rid=rid or secrets.token_hex(16),
            prompt_ids=list(prompt_ids),
            params=params,
            top_logprobs_num=top_logprobs_num,
            weight_version=self.weight_version,
        )
        self._prepare(seq)
        if params.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return seq
        self._waiting.append(seq)
        self._wake.set()
        return seq

    def abort(self, rid: str, message: str = "Aborted by /abort_request.") -> int:
        """Abort every queued or running sequence whose rid starts with ``rid``; return how many."""
        return self._abort_where(lambda s: s.rid.startswith(rid), message)

    def abort_all(self, message: str = "Aborted by abort_all.") -> int:
        return self._abort_where(lambda s: True, message)

    def _abort_where(self, match: Callable[[Sequence], bool], message: str) -> int:
        count = 0
        for seq in [s for s in self._waiting if match(s)]:
            self._waiting.remove(seq)
            self._finish(seq, abort_reason(message))
            count += 1
        for seq in self._running:
            if match(seq) and seq.abort_message is None:
                seq.abort_message = message
                count += 1
        if not self._stepping:
            self._apply_aborts()
        return count

    async def wait_finished(self, seqs: list[Sequence]) -> None:
        """Wait until every one of ``seqs`` finished; any left unfinished (the caller was cancelled: the client
        went away) is aborted."""
        try:
            for seq in seqs:
                while not seq.finished:
                    await seq.wait_changed()
        finally:
            self.abort_unfinished(seqs)

    def abort_unfinished(self, seqs: list[Sequence], message: str = "client disconnected") -> None:
        """Abort those of ``seqs`` not finished (their client is gone)."""
        for seq in seqs:
            if not seq.finished:
                self.abort(seq.rid, message)

    def _apply_aborts(self) -> None:
        for seq in [s for s in self._running if s.abort_message is not None]:
            self._running.remove(seq)
            self._finish(seq, abort_reason(seq.abort_message or "aborted"))

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        seq.finished_at = time.monotonic()
        seq.weight_version = self.weight_version
        self._release(seq)
        self._finished += 1
        seq.changed.set()

    # ---------------------------------------------------------------- pause / weights

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop stepping; returns once no step is in flight.

        ``abort`` aborts every request in flight; ``retract`` drops the running sequences' KV caches and
        requeues them (they are re-prefilled, prompt + output so far, after ``continue_``); ``in_place``
        keeps everything as it is.
        """
        self._paused = True
        async with self._step_lock:
            if mode == "abort":
                self.abort_all("Aborted by /pause_generation (mode=abort).")
            elif mode == "retract":
                for seq in reversed(self._running):
                    self._release(seq)
                    self._waiting.appendleft(seq)
                self._running.clear()

    def continue_(self) -> None:
        self._paused = False
        self._wake.set()

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    # ---------------------------------------------------------------- scheduler

    async def _scheduler(self) -> None:
        while True:
            while self._paused or not (self._waiting or self._running):
                self._wake.clear()
                await self._wake.wait()
            async with self._step_lock:
                if self._paused:
                    continue
                await self._step()
