"""The sandbox role: multi-turn episode steps and verification, two stream actors sharing one pool.

- :class:`EpisodeActor` consumes ``rollout.sandbox.requests`` (key episode_id). ``open`` takes a
  sandbox from the pool for the whole episode (the episode its domain builds, ``Domain.new_episode``: a
  shell session, or a tool executor), ``step`` runs one model reply in it, ``close`` judges the final state and gives the sandbox back (the pool resets it to pristine). Every reply goes to
  ``rollout.sandbox.results`` at the request's ``reply_partition``, key episode_id.
- :class:`VerifyActor` consumes ``rollout.completions`` (key task_id), runs the verifier of the
  completion's domain (``domains.DOMAINS``; a built-in one named in ``spec["verifier"]``
  overrides it) and emits an :class:`~engine.schemas.Outcome` to ``rollout.outcomes``, key task_id.

Invariants:

- Hostile model output or specs never crash an actor: a verifier that fails on them yields facts with
  an ``error`` field and zero counts; absurd spec limits are clamped to the configured maxima
  (:func:`clamp_spec`).
- An infrastructure failure of the sandboxes themselves (``SandboxError``) is re-raised as a
  ``TransportError`` (``streams.protocols``: what roles treat as "the infrastructure failed"), so the
  actor crashes, the supervisor restarts it and the record is re-delivered instead of being scored zero.
- Episodes live in the memory of the process that opened them. A step for an episode this process
  does not hold (the partition moved, the process restarted, the episode idled out) is answered with
  ``error="episode_unknown"``. Requests of one episode are handled one at a time, in arrival order,
  and a re-delivered request already answered is answered again from a cache, not re-executed.
- An episode is one attempt (``SandboxRequest.attempt``, a nonce per generation of the episode): a group
  generated again after its inference actor died reuses the episode id, not the attempt. An ``open`` of a
  new attempt releases the old attempt's sandbox and opens a pristine one; requests of any other attempt
  are answered ``episode_unknown``; the reply cache is keyed by (episode, attempt, step, action). So a
  regenerated episode never sees another attempt's sandbox or observations.

Wiring (``rollout run``)::

    async with SandboxResources(cfg.sandbox) as resources:      # the pool lives as long as this block
        for spec in build_sandbox_actors(rt, resources):
            supervisor.add_spec(spec)
        await supervisor.run()

Without ``resources`` the actors share one created on demand: the pool starts with the first actor's
``setup`` and closes with the last ``teardown`` (a restart of the only actor then re-creates it).

Modules, one concern each: :mod:`.settings` (knobs, spec clamping), :mod:`.resources` (the shared
pool and the actors' common base), :mod:`.episode` (:class:`EpisodeActor`), :mod:`.verify`
(:class:`VerifyActor`, verifier choice); this module wires them.
"""

from __future__ import annotations

from actors.runtime import Runtime
from actors.sandbox.episode import EPISODE_UNKNOWN, EpisodeActor, _KeyedLocks
from actors.sandbox.resources import SandboxResources, sandbox_resources
from actors.sandbox.settings import SandboxSettings, clamp_spec
from actors.sandbox.verify import VerifyActor, failed_facts, pick_verifier
from engine.actor import ActorSpec

__all__ = [
    "EPISODE_UNKNOWN",
    "EpisodeActor",
    "SandboxResources",
    "SandboxSettings",
    "VerifyActor",
    "build_sandbox_actors",
    "clamp_spec",
    "failed_facts",
    "pick_verifier",
    "sandbox_resources",
    "_KeyedLocks",
]


def build_sandbox_actors(rt: Runtime, resources: SandboxResources | None = None) -> list[ActorSpec]:
    """The supervisor's specs of this process's episode actor and verify actor.

    Both share ``resources`` (one pool); see the module docstring for who starts and stops it. The
    episode actor drains after the inference actor when both run under one supervisor: multi-turn
    generations need their sandbox until they end, and a step waiting for a reply that a drained
    episode actor will never send would hold the inference actor's drain until its timeout.
    """
    shared = resources or SandboxResources(rt.cfg.sandbox)
    return [
        ActorSpec("sandbox.episodes", lambda: EpisodeActor(rt, shared), drain_after=("inference",)),
        ActorSpec("sandbox.verify", lambda: VerifyActor(rt, shared)),
    ]
