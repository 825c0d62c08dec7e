"""Verification: a completion -> the facts its domain's verifier finds (in a pooled sandbox) -> an outcome."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, ClassVar

from opentelemetry import trace

from domains import DOMAINS
from actors.runtime import Runtime
from actors.sandbox.resources import SandboxResources, _SandboxActorBase
from actors.sandbox.settings import clamp_spec
from engine.schemas import SANDBOX_ERROR, Completion, Outcome
from sandboxes import SandboxError
from sandboxes.verifiers import VERIFIERS, Facts, Verifier
from streams.protocols import EventRecord, TransportError

log = logging.getLogger("rollout.actors.sandbox")


def pick_verifier(domain: str, spec: dict[str, Any]) -> tuple[str, Verifier]:
    """The verifier of a completion and the name its outcome carries: the built-in one named by
    ``spec["verifier"]`` if set, else the registered domain's (``Domain.verifier_name``, ``Domain.verify``)."""
    override = spec.get("verifier")
    if override is not None:
        if not isinstance(override, str) or override not in VERIFIERS:
            raise ValueError(f"spec.verifier {override!r} is not one of {sorted(VERIFIERS)}")
        return override, VERIFIERS[override]
    registered = DOMAINS.get(domain)
    if registered is None:
        raise ValueError(f"no verifier for domain {domain!r}: it is not registered (domains: {sorted(DOMAINS)})")
    return registered.verifier_name, registered.verify


def failed_facts(kind: str, spec: dict[str, Any], error: str) -> Facts:
    """Facts of a verification that could not be carried out: an ``error`` and nothing passed."""
    facts: Facts = {"error": error[:2000]}
    if kind == "answer":
        facts.update(extracted=None, correct=False)
    elif kind == "code":
        tests = spec.get("tests")
        facts.update(passed=0, total=len(tests) if isinstance(tests, list) else 0, tests=[], exit_codes=[])
    elif kind == "terminal":
        checks = spec.get("checks")
        facts.update(checks_passed=0, checks_total=len(checks) if isinstance(checks, list) else 0, turns=0)
    return facts


class VerifyActor(_SandboxActorBase):
    """Turns completions into outcomes: ``rollout.completions`` -> ``rollout.outcomes``."""

    role: ClassVar[str] = "sandbox.verify"
    topics: ClassVar[list[str]] = ["completions"]
    expect: ClassVar[tuple[str, ...]] = (Completion.SCHEMA,)
    span_name: ClassVar[str | None] = "verify"  # the runtime's span around handle (actors/runtime.py)

    def __init__(self, rt: Runtime, resources: SandboxResources, name: str | None = None) -> None:
        super().__init__(rt, resources, name)
        self.verified: collections.Counter[str] = collections.Counter()
        self.verifier_errors = 0
        self.episodes_lost = 0

    async def handle(self, record: EventRecord) -> None:
        completion = record.message
        assert isinstance(completion, Completion)
        start = time.perf_counter()
        kind, facts, error = await self.verify(completion)
        self.verified[kind] += 1
        outcome = Outcome(completion=completion.to_body(), facts=facts, verifier=kind,
                          verify_s=time.perf_counter() - start, error=error)
        span = trace.get_current_span()  # the runtime's "verify" span (span_name)
        if span.is_recording():
            span.set_attributes({"rollout.sample_id": completion.sample_id, "rollout.task_id": completion.task_id,
                                 "rollout.domain": completion.domain, "rollout.verifier": kind,
                                 "rollout.error": error})
        self.emit(record, self.rt.names.outcomes, outcome, key=completion.task_id)

    async def verify(self, completion: Completion) -> tuple[str, Facts, str]:
        """(verifier kind, facts, error); never raises on bad model output or specs."""
        try:
            kind, verifier = pick_verifier(completion.domain, completion.spec)
        except ValueError as exc:
            self.verifier_errors += 1
            return "none", {"error": str(exc)}, str(exc)
        if completion.finish_reason == SANDBOX_ERROR:
            # The episode lost its sandbox (a host died, the episode idled out, no reply in time) or
            # could not get one: nothing the model did. An error, so the reward actor leaves the
            # sample out of its group's statistics and the learner never trains on it; scored zero, a
            # lost sandbox would push the policy away from whatever the model was doing. Any domain.
            self.episodes_lost += 1
            why = str(completion.episode_facts.get("error", "")) or "no reason given"
            return kind, dict(completion.episode_facts), f"episode lost its sandbox: {why}"[:2000]
        if completion.episode_facts:  # a multi-turn episode (any domain): judged from its own final state
            return kind, dict(completion.episode_facts), ""
        spec, clamped = clamp_spec(completion.spec, self.resources.cfg, self.resources.settings)
        try:
            facts = await verifier(completion.text, spec, self.resources.pool)
            if not isinstance(facts, dict):  # a domain's own verifier broke its contract
                raise TypeError(f"verifier {kind!r} returned {type(facts).__name__}, not a dict of facts")
        except SandboxError as exc:
            raise TransportError(f"sandbox failure verifying {completion.sample_id}: {exc}") from exc
        except Exception as exc:  # hostile output or a malformed spec: a zero score, not a crash
            self.verifier_errors += 1
            error = f"{type(exc).__name__}: {exc}"
            log.info("%s: %s verifier failed on %s: %s", self.name, kind, completion.sample_id, error)
            return kind, failed_facts(kind, spec, error), error
        if clamped:
            facts["clamped"] = clamped
        return kind, facts, ""

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(verified=dict(self.verified), verifier_errors=self.verifier_errors,
                     episodes_lost=self.episodes_lost)
        return stats
