"""The ``eval`` actor: held-out evaluation of the policy being trained, every Nth weight version.

It runs beside the inference role (same process, same servers) when ``eval.every_versions`` is set.
It watches the weight version the server reports and evaluates the version it starts with and then
every version at least ``every_versions`` past the last one evaluated (versions can be skipped by
the server when the learner is faster than the evaluation), with the episodes, sandboxes and
verifiers of `rollout eval` (:mod:`actors.evaluate`) on tasks the scheduler never issues: each
domain's held-out set and, optionally, a user's task file.

Each domain's result is an :class:`engine.schemas.EvalResult` on ``<ns>.rollout.eval`` (key
``<domain>/<version>``) and the actor's ``statistics()["eval"]``, which the dashboard plots beside the
training reward. Training does not wait for it: the learner keeps stepping while an evaluation runs,
and the server may apply newer weights mid-evaluation (the result names the version served when it
started). An evaluation that fails (a server restarting, a sandbox backend down) is logged and
retried at the next due version; it never stops the deployment.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from actors.evaluate import EvalReport, EvalTask, file_tasks, heldout_tasks, run_episodes, summarise
from actors.inference.sglang_client import SGLangClient, SGLangError
from actors.runtime import Runtime
from engine.actor import Actor
from engine.config import EvalConfig
from engine.schemas import EvalResult

log = logging.getLogger("rollout.eval")


def due(version: int, last: int | None, every: int) -> bool:
    """Whether ``version`` should be evaluated, ``last`` being the last version evaluated (None: none yet)."""
    return last is None or version >= last + every


def eval_tasks(cfg: EvalConfig) -> list[EvalTask]:
    """The configured held-out domains' tasks and the task file's rows (TaskFileError / ValueError if bad)."""
    tasks = heldout_tasks(dict(cfg.domains), seed=cfg.seed + 7919) if cfg.domains else []
    if cfg.task_file:
        tasks += file_tasks(cfg.task_file)
    return tasks


def result_message(report: EvalReport, version: int, temperature: float, elapsed_s: float,
                   instance: str) -> EvalResult:
    return EvalResult(
        domain=report.domain, weight_version=version, tasks=report.tasks, samples=report.samples,
        completion_rate=report.completion_rate, completion_ci95=list(report.completion_ci95),
        mean_correctness=report.mean_correctness, pass_at_1=report.pass_at_1, pass_at_k=report.pass_at_k,
        mean_turns=report.mean_turns, mean_tokens=report.mean_tokens, temperature=temperature,
        elapsed_s=round(elapsed_s, 3), instance=instance)


class EvalActor(Actor):
    role = "eval"

    def __init__(self, rt: Runtime, urls: list[str], tokenizer: Any, cfg: EvalConfig, *, sandbox_backend: str = "bwrap",
                 api_key: str | None = None, poll_s: float = 1.0, name: str | None = None) -> None:
        super().__init__(name)
        if cfg.every_versions < 1:
            raise ValueError("EvalActor needs eval.every_versions >= 1")
        self.rt = rt
        self.urls = list(urls)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.sandbox_backend = sandbox_backend
        self.api_key = api_key
        self.poll_s = poll_s
        self.instance = rt.instance
        self.last_version: int | None = None
        self.evaluations = 0
        self.failures = 0
        self.latest: dict[str, dict[str, Any]] = {}
        self._tasks: list[EvalTask] = []

    async def setup(self) -> None:
        self._tasks = eval_tasks(self.cfg)
        log.info("%s: %d held-out tasks (%s), every %d weight versions", self.name, len(self._tasks),
                 ", ".join(sorted({t.domain for t in self._tasks})), self.cfg.every_versions)

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch)
            await self.wait_drain_requested()
            tg.cancel_scope.cancel()  # an evaluation in progress is abandoned: nothing of it was published

    async def _watch(self) -> None:
        async with SGLangClient(self.urls, timeout=30, api_key=self.api_key) as client:
            while True:
                try:
                    version = _as_int(await client.get_weight_version())
                except SGLangError as exc:
                    log.warning("%s: cannot read the served weight version: %s", self.name, exc)
                    version = None
                if version is not None and due(version, self.last_version, self.cfg.every_versions):
                    await self.evaluate(version)
                await anyio.sleep(self.poll_s)  # the server announces no version changes: poll it

    async def evaluate(self, version: int) -> dict[str, EvalReport] | None:
        """Evaluate what the server serves now (``version``), publish each domain's result."""
        started = time.monotonic()
        cfg = self.cfg
        try:
            records = await run_episodes(
                self.urls[0], self._tasks, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens,
                concurrency=cfg.concurrency, samples=cfg.samples, temperature=cfg.temperature,
                tokenizer=self.tokenizer, sandbox_backend=self.sandbox_backend, api_key=self.api_key)
        except (SGLangError, OSError, RuntimeError) as exc:
            self.failures += 1
            log.warning("%s: evaluation of v%d failed (%s: %s); next try at the next due version",
                        self.name, version, type(exc).__name__, exc)
            self.last_version = version
            return None
        reports = summarise(records, cfg.samples)
        elapsed = time.monotonic() - started
        for domain, report in sorted(reports.items()):
            msg = result_message(report, version, cfg.temperature, elapsed, self.instance)
            fut, _ = self.rt.producer.send_nowait(self.rt.names.eval, msg, key=f"{domain}/{version}")
            await fut
            self.latest[domain] = {"accuracy": report.completion_rate, "version": version,
                                   "ci95": list(report.completion_ci95), "pass_at_k": report.pass_at_k}
        self.last_version = version
        self.evaluations += 1
        log.info("%s: v%d evaluated in %.1f s: %s", self.name, version, elapsed,
                 ", ".join(f"{d} {r.completion_rate:.3f}" for d, r in sorted(reports.items())))
        return reports

    def statistics(self) -> dict[str, Any]:
        return {**super().statistics(), "evaluations": self.evaluations, "failures": self.failures,
                "last_version": self.last_version, "eval": {d: dict(v) for d, v in self.latest.items()}}


def _as_int(v: str | None) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None
