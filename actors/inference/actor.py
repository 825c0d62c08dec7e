"""The inference role: tasks in, streamed tokens and finished samples out.

For each task from ``rollout.tasks`` it generates the task's group of samples concurrently:

- every generation streams; new tokens go to ``rollout.tokens`` (key sample_id) as they arrive, one
  record per ``inference.stream_interval`` tokens (and the rest when the generation ends);
- token ids are kept exactly as produced (token-in-token-out: the prompt is tokenised once, the
  model's tokens are never re-tokenised), with the behaviour logprob and the weight version of
  every token;
- a weight update aborts generations in flight (``abort_all_requests``); an aborted generation is
  resumed from prompt + tokens so far, so its tokens are kept and tagged with the version that made
  them (partial rollouts); with ``inference.partial_rollouts = false`` the update instead waits for the
  generations in flight to end, holding new ones back (:class:`GenerationGate`);
- multi-turn episodes (``max_turns > 1``) alternate a model turn (one command, up to a newline, or a chat
  model's whole turn) with a sandbox step over ``rollout.sandbox.requests`` / ``rollout.sandbox.results``;
  observation tokens get loss mask 0, logprob 0 and version -1. The context of a turn is the prompt ids,
  the model's own sampled ids and the observation ids appended, never re-tokenised. A task's ``tools`` are
  declared in its prompt (the chat template's ``tools=``, else a Hermes block); the steps of a ``tools``
  episode come back as the template's ``tool`` turns, whole (:func:`observation_ids`).

The finished sample goes to ``rollout.completions`` (key task_id). The task record is acknowledged
only after all its completions are: after a crash the task comes again, to this actor's successor, which
continues each single-turn sample from the tokens the broker had acknowledged on ``rollout.tokens``
(:mod:`actors.inference.resume`; the last chunk of a finished generation is marked ``done``); a multi-turn
episode starts again in a fresh sandbox.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from actors import tracing
from modelserver.llm import has_chat_template, render_observation, render_prompt
from modelserver.client import GenerateResult, SGLangClient, SGLangError
from actors.inference.resume import Frontier, Frontiers
from actors.runtime import INFRA_ERRORS, Released, Runtime, StreamActor
from engine.schemas import EPISODES_FULL, SANDBOX_ERROR, Completion, SandboxRequest, SandboxResult, Task, TokenChunk
from streams.protocols import AssignedConsumer, EventRecord
from streams.weights import WeightSubscriber

log = logging.getLogger("rollout.inference")

OBSERVATION_LIMIT = 400  # characters of sandbox output fed back to the model per step


def format_observation(output: str) -> str:
    """How a sandbox step's output is shown to the model (domains' demonstrations use the same)."""
    output = output[-OBSERVATION_LIMIT:]
    return f"{output}{'' if not output or output.endswith(chr(10)) else chr(10)}$ "


Observation = str | list[dict[str, Any]]
"""What one episode step hands back: a shell episode's output text, or a ``tools`` episode's chat messages."""


def observation_text(observation: Observation) -> str:
    """A step's observation as plain text (the messages' contents joined, for a ``tools`` step)."""
    if isinstance(observation, str):
        return observation
    return "\n\n".join(str(m.get("content") or "") for m in observation)


def observation_ids(tokenizer: Any, observation: Observation, last_id: int | None) -> list[int]:
    """The token ids that follow the model's reply (ending in ``last_id``) to hand it one step's observation:
    what the inference actor appends to a sample and the evaluation to its context, the same for both.

    - messages (a ``tools`` episode's step), chat model: rendered by the chat template as those turns
      (``tool`` role), whole: each tool result is already capped by the tool executor (head and tail kept);
    - text (a shell episode's step), chat model: :func:`format_observation` (its last 400 characters and a
      ``$`` prompt) as a user turn;
    - a model without a chat template: :func:`format_observation` of the text, after a newline unless the
      model's reply ended with one.
    """
    if has_chat_template(tokenizer):
        ended = last_id is not None and last_id == tokenizer.eos_token_id
        shown = observation if isinstance(observation, list) else format_observation(observation)
        return render_observation(tokenizer, shown, ended_turn=ended)
    text = format_observation(observation_text(observation))
    if last_id is None or last_id != tokenizer.convert_tokens_to_ids("\n"):
        text = "\n" + text
    return list(tokenizer.encode(text, add_special_tokens=False))


class SandboxUnavailable(RuntimeError):
    """A sandbox step got no answer in time, or the sandbox actor lost the episode."""


class SandboxFull(SandboxUnavailable):
    """The sandbox host refused to open an episode: it holds as many as it may (backpressure)."""


class GenerationGate:
    """Generation streams (many at once) against weight updates that must not interrupt them.

    ``async with gate.stream()`` around one generation stream; ``async with gate.exclusive()`` around a
    weight update: it closes the gate to new streams, waits until the running ones end, and reopens when
    done. Used when partial rollouts are off.
    """

    def __init__(self) -> None:
        self.active = 0
        self.closed = False
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[None]:
        while self.closed:
            await self._changed.wait()
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            self._notify()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        while self.closed:  # another update holds it
            await self._changed.wait()
        self.closed = True
        try:
            while self.active:
                await self._changed.wait()
            yield
        finally:
            self.closed = False
            self._notify()


class _Sample:
    """Per-token arrays of one sample as it grows."""

    def __init__(self, sample_id: str) -> None:
        self.sample_id = sample_id
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.versions: list[int] = []
        self.chunks = 0

    def add_model_tokens(self, ids: list[int], lps: list[float], versions: list[int]) -> None:
        self.ids += ids
        self.logprobs += lps
        self.mask += [1] * len(ids)
        self.versions += versions

    def take_final_logprobs(self, final: GenerateResult, produced: int) -> None:
        """The logprobs of a finished generation's last chunk replace those streamed for its ``produced`` tokens.

        A server that re-scores a finished sample (the local server's ``rescore``: one full-sequence
        forward, the learner's computation) reports the re-scored logprobs on the last chunk only; the
        tokens streamed to ``rollout.tokens`` before it carry the decode-time ones.
        """
        lps = final.logprobs or []
        if produced and len(lps) == produced and len(self.logprobs) >= produced:
            self.logprobs[len(self.logprobs) - produced:] = [float(x) for x in lps]

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [-1] * len(ids)


def _sample_id(task: Task, index: int) -> str:
    """Sample ``index`` of ``task``'s group: the same id whichever actor generates it (resume.py finds its chunks)."""
    return f"{task.task_id}/{index}"


def _version_int(v: str | None, default: int) -> int:
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


class InferenceActor(StreamActor):
    role = "inference"
    topics = ["tasks"]
    expect = ("task",)
    infra_errors = INFRA_ERRORS + (SGLangError,)  # a failing server must not dead-letter tasks
    # No ``span_name``: one task fans out into ``group_size`` samples, each traced as its own ``generate``
    # span (``record_span``, the hook's span opener) so a sample's sandbox steps and verify hang under it.

    def __init__(self, rt: Runtime, urls: list[str], tokenizer: Any, *, reply_partition: int = 0,
                 weights_dir: str | Path | None = None, name: str | None = None) -> None:
        super().__init__(rt, name)
        cfg = rt.cfg.inference
        self.urls = urls
        self.tokenizer = tokenizer
        self.reply_partition = reply_partition
        self.concurrency = max(1, cfg.concurrency // max(1, rt.cfg.scheduler.group_size))
        self.stream_interval = cfg.stream_interval
        self.client: SGLangClient | None = None
        self.results: AssignedConsumer | None = None
        # by (episode_id, attempt, step): a reply to another attempt of a regenerated episode never matches
        self._replies: dict[tuple[str, str, int], SandboxResult] = {}
        self._reply_events: dict[tuple[str, str, int], anyio.Event] = {}
        self.weight_version = 0
        self._version_applied = anyio.Event()  # set (and replaced) whenever a weight version is applied
        self._update_epoch = 0  # bumped as a weight update begins and as it ends; an abort seen across a bump is resumed
        self._updates_in_flight = 0  # an abort that comes while an update is in flight is resumed too
        self._weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="rollout-weights-"))
        self.samples_done = 0
        self.tokens_out = 0
        self.chunks_out = 0  # rollout.tokens records
        self.resumed = 0
        self.samples_taken_over = 0  # samples continued from another actor's chunks (resume.py)
        self.stream_breaks = 0  # taken-over samples whose chunks had a gap or a conflict (resume.py)
        self.tokens_taken_over = 0
        self.waited_for_sandbox = 0
        self.frontiers: Frontiers | None = None
        self.partial_rollouts = cfg.partial_rollouts
        self._gate = GenerationGate()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def setup(self) -> None:
        cfg = self.rt.cfg.inference
        self.client = SGLangClient(self.urls, timeout=cfg.request_timeout_s, api_key=cfg.resolved_api_key())
        self.weight_version = _version_int(await self.client.get_weight_version(), 0)
        self.frontiers = Frontiers(self.rt.event_log, self.rt.names.tokens, window_s=cfg.resume_window_s)
        self.results = await self.rt.assigned_consumer(
            "inference-results", partitions=[(self.rt.names.sandbox_results, self.reply_partition)],
            expect=(SandboxResult.SCHEMA,), from_end=True).start()
        await super().setup()

    async def teardown(self) -> None:
        await super().teardown()
        if self.results is not None:
            results, self.results = self.results, None
            await results.close()
        if self.client is not None:
            client, self.client = self.client, None
            await client.aclose()

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._dispatch_results)
            if self.rt.control is not None:
                tg.start_soon(self._watch_weights)
            await super().serve()
            tg.cancel_scope.cancel()

    # -- weights -----------------------------------------------------------------------------------
    async def _watch_weights(self) -> None:
        assert self.client is not None
        sub = WeightSubscriber(self.rt.require_control(), self.rt.names, self._weights_dir,
                               timeout_s=self.rt.cfg.inference.weight_sync_timeout_s)
        async for manifest in sub.manifests():
            if manifest.version <= self.weight_version:
                continue
            vdir = await sub.fetch(manifest)
            if self.partial_rollouts:
                with anyio.fail_after(self.rt.cfg.inference.weight_sync_timeout_s), self._weights_swap():
                    await self.client.update_weights_from_disk(str(vdir), weight_version=str(manifest.version),
                                                               abort_all_requests=True)
            else:
                async with self._gate.exclusive():  # every generation in flight ends first; none starts meanwhile
                    with anyio.fail_after(self.rt.cfg.inference.weight_sync_timeout_s):
                        await self.client.update_weights_from_disk(str(vdir), weight_version=str(manifest.version),
                                                                   abort_all_requests=False)
            self.weight_version = manifest.version
            self._version_applied.set()
            self._version_applied = anyio.Event()
            log.info("%s: applied weight version %d", self.name, manifest.version)

    @contextlib.contextmanager
    def _weights_swap(self) -> Iterator[None]:
        """Around a weight update that aborts the server's requests (partial rollouts): every generation
        aborted meanwhile is resumed with its tokens kept. One that began after the update started (its
        epoch already bumped) and was aborted by it is caught by the in-flight count, or by the second
        bump when its abort arrives after the update returned."""
        self._update_epoch += 1
        self._updates_in_flight += 1
        try:
            yield
        finally:
            self._updates_in_flight -= 1
            self._update_epoch += 1

    # -- sandbox replies ---------------------------------------------------------------------------
    async def _dispatch_results(self) -> None:
        assert self.results is not None
        while True:
            for r in await self.results.getmany(timeout_s=0.2):
                res = r.message
                assert isinstance(res, SandboxResult)
                key = (res.episode_id, res.attempt, res.step)
                event = self._reply_events.get(key)
                if event is not None:
                    self._replies[key] = res
                    event.set()
                r.ack()

    async def _sandbox(self, record: EventRecord, req: SandboxRequest) -> SandboxResult:
        key = (req.episode_id, req.attempt, req.step)
        event = self._reply_events[key] = anyio.Event()
        try:
            self.emit(record, self.rt.names.sandbox_requests, req, key=req.episode_id,
                      headers=tracing.trace_headers())
            with anyio.move_on_after(self.rt.cfg.sandbox.timeout_s * 3 + 30):
                await event.wait()
            reply = self._replies.pop(key, None)
        finally:
            self._reply_events.pop(key, None)
        if reply is None:
            raise SandboxUnavailable(f"no sandbox reply for {req.episode_id} step {req.step}")
        if reply.error:
            kind = SandboxFull if reply.error == EPISODES_FULL else SandboxUnavailable
            raise kind(f"sandbox error for {req.episode_id} step {req.step}: {reply.error}")
        return reply

    async def _open_episode(self, record: EventRecord, req: SandboxRequest) -> SandboxResult:
        """Open an episode, waiting (with backoff) while the sandbox hosts are full.

        ``too_many_episodes`` is backpressure, not a failure: more episodes are in flight than the hosts
        hold. Retrying here keeps the waiting on this side instead of in the sandbox actor's handler
        slots, which the steps and closes that free a place need. Gives up after ``sandbox.timeout_s * 3
        + 30`` seconds, like a reply that never comes.
        """
        deadline = time.monotonic() + self.rt.cfg.sandbox.timeout_s * 3 + 30
        delay = 0.1
        while True:
            try:
                return await self._sandbox(record, req)
            except SandboxFull:
                if time.monotonic() + delay > deadline:
                    raise
                self.waited_for_sandbox += 1
                await anyio.sleep(delay)  # a retry backoff, not a readiness wait
                delay = min(2.0, delay * 2)

    # -- generation --------------------------------------------------------------------------------
    async def _await_weights(self, task: Task) -> None:
        """Hold a task admitted at learner version v until weights of version v are applied here.

        The scheduler admits by the learner's version; generating with older weights would make
        samples staler than the bound admission keeps (with ``max_staleness = 0`` every one of them
        would be dropped). Versions are published every ``learner.publish_every`` steps, so the wait is
        for the last published version at or below v. Bounded by ``weight_sync_timeout_s``: if the
        weights do not come, the task is generated anyway and the learner judges its staleness.
        """
        every = self.rt.cfg.learner.publish_every
        wanted = task.admitted_version - task.admitted_version % every
        if self.rt.control is None or self.weight_version >= wanted:
            return
        with anyio.move_on_after(self.rt.cfg.inference.weight_sync_timeout_s):
            async with anyio.create_task_group() as tg:
                async def give_back_on_drain() -> None:
                    await self.wait_drain_requested()
                    tg.cancel_scope.cancel()

                tg.start_soon(give_back_on_drain)
                while self.weight_version < wanted:
                    await self._version_applied.wait()
                tg.cancel_scope.cancel()
        if self.weight_version < wanted and self.draining:
            # nothing generated yet: hand the task back rather than hold the drain for weights that
            # may never come (the learner may be gone); the next owner of the partition generates it
            raise Released(f"draining while task {task.task_id} waited for weights v{wanted} "
                           f"(have v{self.weight_version})")
        if self.weight_version < wanted:
            log.warning("%s: task %s admitted at version %d; weights still at %d after %.0fs, generating anyway",
                        self.name, task.task_id, task.admitted_version, self.weight_version,
                        self.rt.cfg.inference.weight_sync_timeout_s)

    async def handle(self, record: EventRecord) -> None:
        task = record.message
        assert isinstance(task, Task)
        await self._await_weights(task)
        prompt_ids = (task.prompt_ids.tolist() if task.prompt_ids is not None
                      else render_prompt(self.tokenizer, task.prompt, tools=task.tools or None))
        completions: list[Completion | None] = [None] * task.group_size
        headers: list[dict[str, str]] = [{} for _ in range(task.group_size)]
        taken: dict[str, Frontier] = {}
        owned_since = record.owned_since_ms
        if (task.max_turns <= 1 and self.frontiers is not None
                and self.frontiers.may_have_frontiers(record.timestamp_ms, owned_since)):
            taken = await self.frontiers.take(record.timestamp_ms,
                                              [_sample_id(task, i) for i in range(task.group_size)], owned_since)
            for sid, front in list(taken.items()):
                if front.broken:
                    self.stream_breaks += 1
                    log.warning("%s: %s's stream on %s is broken: %s (%d chunk(s) not taken); it %s", self.name,
                                sid, self.rt.names.tokens, front.broken, front.ignored,
                                f"continues from its first {front.chunks} chunk(s)" if front.chunks
                                else "is generated from scratch")
                    if not front.chunks:
                        del taken[sid]
        async with anyio.create_task_group() as tg:
            for i in range(task.group_size):
                tg.start_soon(self._run_sample, record, task, i, prompt_ids, completions, headers,
                              taken.get(_sample_id(task, i)))
        for c, h in zip(completions, headers):
            assert c is not None
            self.emit(record, self.rt.names.completions, c, key=task.task_id, headers=h)

    async def _run_sample(self, record: EventRecord, task: Task, index: int, prompt_ids: list[int],
                          out: list[Completion | None], out_headers: list[dict[str, str]],
                          frontier: Frontier | None = None) -> None:
        """Generate sample ``index`` of the group under its ``generate`` span (the parent of its sandbox steps)."""
        with self.record_span(record, "generate") as span:
            completion = await self._generate_sample(record, task, index, prompt_ids, frontier)
            if span.is_recording():
                versions = sorted({int(v) for v in completion.weight_versions.tolist() if v >= 0})
                span.set_attributes({
                    "rollout.task_id": task.task_id, "rollout.sample_id": completion.sample_id,
                    "rollout.domain": task.domain, "rollout.group_index": index,
                    "rollout.prompt_tokens": len(prompt_ids),
                    "rollout.response_tokens": len(completion.response_ids),
                    "rollout.model_tokens": int(completion.loss_mask.sum()),
                    "rollout.weight_versions": versions, "rollout.weight_version": self.weight_version,
                    "rollout.finish_reason": completion.finish_reason, "rollout.turns": completion.turns})
            out_headers[index] = tracing.trace_headers(span)
        out[index] = completion

    async def _generate_sample(self, record: EventRecord, task: Task, index: int, prompt_ids: list[int],
                               frontier: Frontier | None = None) -> Completion:
        sample = _Sample(_sample_id(task, index))
        sampling = self._sampling(task)
        transcript: list[dict[str, Any]] = []
        episode_facts: dict[str, Any] = {}
        if task.max_turns <= 1 and frontier is not None:
            finish = await self._continue(record, task, sample, prompt_ids, sampling, frontier)
        elif task.max_turns <= 1:
            finish = await self._generate(record, task, sample, prompt_ids, sampling, sampling["max_new_tokens"])
        else:
            finish, episode_facts = await self._episode(record, task, sample, prompt_ids, sampling, transcript)
        model_ids = [t for t, m in zip(sample.ids, sample.mask) if m]
        completion = Completion(
            sample_id=sample.sample_id, task_id=task.task_id, domain=task.domain, group_index=index,
            group_size=task.group_size, prompt_ids=np.asarray(prompt_ids, np.int32),
            response_ids=np.asarray(sample.ids, np.int32), logprobs=np.asarray(sample.logprobs, np.float32),
            loss_mask=np.asarray(sample.mask, np.uint8), weight_versions=np.asarray(sample.versions, np.int32),
            text=self.tokenizer.decode(model_ids, skip_special_tokens=True), finish_reason=finish,
            spec=task.spec, turns=max(1, len(transcript)), admitted_version=task.admitted_version,
            transcript=transcript, episode_facts=episode_facts, temperature=float(sampling["temperature"]))
        self.samples_done += 1
        return completion

    def _stream_tokens(self, record: EventRecord, task: Task, sample: _Sample,
                       unsent: tuple[list[int], list[float], list[int]], headers: dict[str, str], *,
                       finish_reason: str = "") -> None:
        """One ``rollout.tokens`` record of the tokens not yet streamed; empties ``unsent``. With
        ``finish_reason`` it is the generation's last (``done``), with or without tokens.

        The sample's trace context goes on its first chunk only: later chunks share its key
        (sample_id), partition and order, so a consumer that wants their trace has it.
        """
        ids, lps, vers = unsent
        last = vers[-1] if vers else (sample.versions[-1] if sample.versions else self.weight_version)
        self.emit(record, self.rt.names.tokens, TokenChunk(
            sample_id=sample.sample_id, task_id=task.task_id, seq=sample.chunks,
            token_ids=np.asarray(ids, np.int32), logprobs=np.asarray(lps, np.float32), weight_version=last,
            weight_versions=None if all(v == last for v in vers) else np.asarray(vers, np.int32),
            done=bool(finish_reason), finish_reason=finish_reason),
            key=sample.sample_id, headers=headers, trace=sample.chunks == 0)
        sample.chunks += 1
        self.chunks_out += 1
        for part in unsent:
            part.clear()

    def _sampling(self, task: Task) -> dict[str, Any]:
        """The task's sampling parameters over ``inference``'s defaults; the temperature must be > 0.

        The temperature travels with the sample (``Completion.temperature``): the learner scores the
        tokens at ``logits / temperature`` as the server sampled them. A greedy (0) temperature has no
        such distribution, so such a task is refused here (dead-lettered with this reason) rather than
        trained at the wrong one.
        """
        cfg = self.rt.cfg.inference
        s = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
        s.update(task.sampling)
        t = s["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"task {task.task_id}: sampling temperature {t!r} is not a number > 0 (a trained "
                             "sample is scored at logits / temperature; greedy decoding has no such distribution)")
        return s

    async def _generate(self, record: EventRecord, task: Task, sample: _Sample, context: list[int],
                        sampling: dict[str, Any], budget: int, *, whole_sample: bool = True) -> str:
        """Generate up to ``budget`` tokens after ``context``; resumes across weight updates. When the
        generation is the ``whole_sample`` (not one turn of an episode) its last chunk is marked ``done``."""
        assert self.client is not None
        mine: list[int] = []  # tokens this call produced, across resumed attempts
        attempt = 0
        chunk_headers = tracing.trace_headers()  # the sample's span: on its first token chunk
        while True:
            epoch = self._update_epoch
            params = dict(sampling, max_new_tokens=budget - len(mine))
            final: GenerateResult | None = None
            seen = 0
            # without partial rollouts a weight update waits for this stream to end (and holds new ones back)
            gate: contextlib.AbstractAsyncContextManager[None] = (
                contextlib.nullcontext() if self.partial_rollouts else self._gate.stream())
            async with gate:
                stream = self.client.generate_stream(context + mine, sampling_params=params,
                                                     rid=f"{sample.sample_id}#{attempt}", key=sample.sample_id)
                unsent: tuple[list[int], list[float], list[int]] = ([], [], [])
                async for chunk in stream:
                    new_ids = chunk.output_ids[seen:]
                    if new_ids:
                        lps = (chunk.logprobs or [])[seen:]
                        if len(lps) != len(new_ids):
                            raise SGLangError(f"server returned {len(lps)} logprobs for {len(new_ids)} tokens")
                        if chunk.token_weight_versions is not None:
                            vers = [_version_int(v, self.weight_version) for v in chunk.token_weight_versions[seen:]]
                        else:
                            vers = [_version_int(chunk.weight_version, self.weight_version)] * len(new_ids)
                        sample.add_model_tokens(new_ids, lps, vers)
                        mine += new_ids
                        unsent[0].extend(new_ids)
                        unsent[1].extend(lps)
                        unsent[2].extend(vers)
                        self.tokens_out += len(new_ids)
                        seen = len(chunk.output_ids)
                    if chunk.finished:
                        final = chunk  # its tokens go out below, in the record marked done (no extra record)
                    elif len(unsent[0]) >= self.stream_interval:
                        self._stream_tokens(record, task, sample, unsent, chunk_headers)
            assert final is not None
            kind = final.finish_type or "unknown"
            aborted = kind == "abort"
            swapped = self._update_epoch != epoch or self._updates_in_flight > 0
            again = aborted and swapped and len(mine) < budget and not self.draining
            if aborted and len(mine) >= budget:
                kind = "length"  # aborted just as its budget ran out: whole, not cut short (its logprobs as streamed)
            done = whole_sample and not again
            if unsent[0] or done:  # the rest, once the stream has ended; the last record of the sample is done
                self._stream_tokens(record, task, sample, unsent, chunk_headers, finish_reason=kind if done else "")
            if not aborted:
                sample.take_final_logprobs(final, seen)
            if again:
                attempt += 1
                self.resumed += 1
                continue  # interrupted by a weight update: resume with the tokens kept
            return kind

    async def _continue(self, record: EventRecord, task: Task, sample: _Sample, prompt_ids: list[int],
                        sampling: dict[str, Any], frontier: Frontier) -> str:
        """A single-turn sample another actor was generating when it died: its tokens on ``rollout.tokens``
        kept as they were (ids, logprobs, versions), the rest generated after them, the chunks numbered on."""
        ids, lps, versions = frontier.tokens()
        sample.add_model_tokens(ids, lps, versions)
        sample.chunks = frontier.chunks
        self.samples_taken_over += 1
        self.tokens_taken_over += len(ids)
        if frontier.finished:
            return frontier.finish_reason  # it had finished: nothing left to generate, nothing to stream
        budget = int(sampling["max_new_tokens"]) - len(ids)
        stops = {self.tokenizer.eos_token_id, *(sampling.get("stop_token_ids") or [])} - {None}
        ended = "length" if budget <= 0 else ("stop" if ids and ids[-1] in stops and not sampling.get("ignore_eos")
                                              else "")
        if ended:  # it had ended; only its done record was lost
            self._stream_tokens(record, task, sample, ([], [], []), tracing.trace_headers(), finish_reason=ended)
            return ended
        log.info("%s: %s continues from %d tokens another actor streamed", self.name, sample.sample_id, len(ids))
        return await self._generate(record, task, sample, prompt_ids + ids, sampling, budget)

    async def _episode(self, record: EventRecord, task: Task, sample: _Sample, prompt_ids: list[int],
                       sampling: dict[str, Any], transcript: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        """A multi-turn episode: model command, sandbox observation, ... then the final-state checks."""
        episode = sample.sample_id
        # The sample id (so the episode id) is the same when the group is generated again after a crash;
        # the attempt is not, so this generation gets a pristine sandbox and none of an old attempt's replies.
        attempt = uuid.uuid4().hex[:16]
        step = 0

        def req(action: str, command: str = "") -> SandboxRequest:
            return SandboxRequest(episode_id=episode, step=step, action=action, reply_partition=self.reply_partition,
                                  domain=task.domain, command=command, spec=task.spec if action == "open" else {},
                                  attempt=attempt)

        try:
            await self._open_episode(record, req("open"))
            chat = has_chat_template(self.tokenizer)
            # a chat model's turn ends at its end-of-turn token; the char fixture's at a newline
            turn_sampling = sampling if chat else dict(sampling, stop=list(sampling.get("stop", [])) + ["\n"])
            per_turn = max(1, int(sampling["max_new_tokens"]))
            finish = "stop"
            for _ in range(task.max_turns):
                start = len(sample.ids)
                finish = await self._generate(record, task, sample, prompt_ids + sample.ids, turn_sampling, per_turn,
                                              whole_sample=False)
                command = self.tokenizer.decode(sample.ids[start:], skip_special_tokens=True).strip()
                if not command or command in ("exit", "done"):
                    transcript.append({"command": command, "observation": ""})
                    break
                step += 1
                result = await self._sandbox(record, req("step", command))
                transcript.append({"command": command, "observation": result.observation[-OBSERVATION_LIMIT:],
                                   "exit_code": result.exit_code})
                # The model's own tokens (its end-of-turn token or newline, if it stopped on one) stay as
                # sampled; the observation's ids follow them. A tools task's step: its tool messages, whole.
                observation: Observation = result.messages if task.tools and result.messages else result.observation
                sample.add_observation(observation_ids(self.tokenizer, observation, sample.ids[-1] if sample.ids else None))
            step += 1
            closed = await self._sandbox(record, req("close"))
            return finish, dict(closed.facts)
        except SandboxUnavailable as exc:
            log.warning("%s: episode %s lost its sandbox: %s", self.name, episode, exc)
            return SANDBOX_ERROR, {"error": str(exc)}

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(weight_version=self.weight_version, samples_done=self.samples_done,
                     tokens_out=self.tokens_out, chunks_out=self.chunks_out, resumed=self.resumed,
                     samples_taken_over=self.samples_taken_over, tokens_taken_over=self.tokens_taken_over,
                     stream_breaks=self.stream_breaks,
                     waited_for_sandbox=self.waited_for_sandbox)
        return stats
