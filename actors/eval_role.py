"""The ``eval`` actor: held-out evaluation of the policy being trained, every Nth weight version.

It runs beside the inference role (same process, same servers) when ``eval.every_versions`` is set.
It watches the weight version the server reports and evaluates the version it starts with and then
every version at least ``every_versions`` past the last one evaluated (versions can be skipped by
the server when the learner is faster than the evaluation), with the episodes, sandboxes and
verifiers of `rollout eval` (:mod:`actors.evaluate`) on tasks the scheduler never issues: each
domain's held-out set (``eval.domains``; empty: every domain the scheduler trains, ``eval.tasks_per_domain``
tasks each) and, optionally, a user's task file.

Regressions: :class:`RegressionWatch` keeps each domain's best accuracy of the run; a domain more than
``eval.regression_threshold`` below it is flagged (a warning, ``statistics()["eval_alerts"]`` and
``eval[domain]["regressed"]``), and the latest accuracies with their flags are put under
:data:`EVAL_STATUS_KEY` in the control KV bucket, where the scheduler's ``signal`` balancing reads them
(a regressed domain is sampled more, ``scheduler.balance.regression_boost``) and a restarted eval actor
takes the bests back.

Each domain's result is an :class:`engine.schemas.EvalResult` on ``<ns>.rollout.eval`` (key
``<domain>/<version>``) and the actor's ``statistics()["eval"]``, which the dashboard plots beside the
training reward. Training does not wait for it: the learner keeps stepping while an evaluation runs,
and the server may apply newer weights mid-evaluation (the result names the version served when it
started). An evaluation that fails (a server restarting, a sandbox backend down) is logged and
retried at the next due version; it never stops the deployment.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import anyio

from domains import DOMAINS
from actors.evaluate import EvalReport, EvalTask, file_tasks, heldout_tasks, run_episodes, summarise
from modelserver.client import SGLangClient, SGLangError
from actors.runtime import Runtime
from engine.actor import Actor
from engine.config import EvalConfig
from engine.schemas import EvalResult
from engine.topics import Names

log = logging.getLogger("rollout.eval")

EVAL_STATUS_KEY = Names.EVAL_STATUS_KEY
"""Control-bucket KV key of the latest evaluation per domain (JSON ``{"domains": {d: {"accuracy", "best",
"best_version", "version", "regressed"}}}``)."""


def due(version: int, last: int | None, every: int) -> bool:
    """Whether ``version`` should be evaluated, ``last`` being the last version evaluated (None: none yet)."""
    return last is None or version >= last + every


def eval_tasks(cfg: EvalConfig, trained: Sequence[str] = ()) -> list[EvalTask]:
    """The held-out tasks of ``eval.domains`` (empty: of every ``trained`` domain, ``tasks_per_domain`` each)
    and the task file's rows. ValueError naming a domain that is unknown or has no held-out task (TaskFileError
    for a bad file)."""
    domains = dict(cfg.domains) or {d: cfg.tasks_per_domain for d in trained}
    field = "eval.domains" if cfg.domains else "eval (every trained domain, as eval.domains is empty)"
    tasks: list[EvalTask] = []
    for name, n in domains.items():
        try:
            DOMAINS[name]
            got = heldout_tasks({name: n}, seed=cfg.seed + 7919)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{field}: domain {name!r}: {exc}") from None
        if not got:
            raise ValueError(f"{field}: domain {name!r} has no held-out task")
        tasks += got
    if cfg.task_file:
        tasks += file_tasks(cfg.task_file)
    return tasks


class RegressionWatch:
    """Each domain's best held-out accuracy of the run, and which domains fell more than ``threshold`` below it."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.best: dict[str, tuple[float, int]] = {}
        """domain -> (best accuracy, its version)."""
        self.latest: dict[str, tuple[float, int]] = {}
        self.alerts = 0
        """Regressions flagged (a domain counts again after it recovered and fell again)."""
        self._regressed: set[str] = set()

    def observe(self, domain: str, version: int, accuracy: float) -> bool:
        """Take one evaluation; True when ``domain`` is (now) regressed."""
        best = self.best.get(domain)
        if best is None or accuracy > best[0]:
            self.best[domain] = best = (accuracy, version)
        self.latest[domain] = (accuracy, version)
        regressed = best[0] - accuracy > self.threshold
        if regressed and domain not in self._regressed:
            self.alerts += 1
            log.warning("eval: %s regressed: held-out accuracy %.3f at v%d, %.3f below its best %.3f (v%d)",
                        domain, accuracy, version, best[0] - accuracy, best[0], best[1])
        elif not regressed and domain in self._regressed:
            log.info("eval: %s recovered: held-out accuracy %.3f at v%d (best %.3f)", domain, accuracy, version,
                     best[0])
        (self._regressed.add if regressed else self._regressed.discard)(domain)
        return regressed

    def regressed(self, domain: str) -> bool:
        return domain in self._regressed

    def status(self) -> dict[str, Any]:
        """The ``EVAL_STATUS_KEY`` value."""
        return {"updated_at": time.time(), "alerts": self.alerts, "domains": {
            d: {"accuracy": acc, "version": v, "best": self.best[d][0], "best_version": self.best[d][1],
                "regressed": d in self._regressed} for d, (acc, v) in sorted(self.latest.items())}}

    def restore(self, status: dict[str, Any]) -> None:
        """Take back the bests (and flags) of :meth:`status` (a restarted eval actor)."""
        self.alerts = int(status.get("alerts", 0))
        for d, e in dict(status.get("domains", {})).items():
            self.best[d] = (float(e["best"]), int(e["best_version"]))
            self.latest[d] = (float(e["accuracy"]), int(e["version"]))
            if e.get("regressed"):
                self._regressed.add(d)


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
        self.watch = RegressionWatch(cfg.regression_threshold)

    async def setup(self) -> None:
        self._tasks = eval_tasks(self.cfg, self.rt.cfg.trained_domains())
        if self.rt.control is not None:
            saved = await self.rt.control.kv_get(self.rt.kv_bucket, EVAL_STATUS_KEY)
            if saved:
                try:
                    self.watch.restore(json.loads(saved))
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("%s: ignoring an unreadable %s: %s", self.name, EVAL_STATUS_KEY, exc)
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
            regressed = self.watch.observe(domain, version, report.completion_rate)
            self.latest[domain] = {"accuracy": report.completion_rate, "version": version,
                                   "ci95": list(report.completion_ci95), "pass_at_k": report.pass_at_k,
                                   "best": self.watch.best[domain][0], "regressed": regressed}
        if self.rt.control is not None:
            await self.rt.control.kv_put(self.rt.kv_bucket, EVAL_STATUS_KEY, json.dumps(self.watch.status()).encode())
        self.last_version = version
        self.evaluations += 1
        log.info("%s: v%d evaluated in %.1f s: %s", self.name, version, elapsed,
                 ", ".join(f"{d} {r.completion_rate:.3f}" for d, r in sorted(reports.items())))
        return reports

    def statistics(self) -> dict[str, Any]:
        alerts = {d: {"accuracy": e["accuracy"], "best": e["best"], "drop": e["best"] - e["accuracy"]}
                  for d, e in self.latest.items() if e.get("regressed")}
        return {**super().statistics(), "evaluations": self.evaluations, "failures": self.failures,
                "last_version": self.last_version, "eval": {d: dict(v) for d, v in self.latest.items()},
                "eval_regressions": self.watch.alerts, "eval_alerts": alerts}


def _as_int(v: str | None) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None
