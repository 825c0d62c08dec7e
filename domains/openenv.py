"""OpenEnv environments as engine domains, single- or multi-turn (optional: ``pip install openenv``).

OpenEnv (Meta PyTorch + Hugging Face) environments speak ``reset(seed=...) -> Observation`` and
``step(Action) -> Observation``, each observation carrying ``done`` and ``reward``. :func:`openenv_domain` turns
one into a :class:`~domains.base.Domain`:

- **in process**: ``env=`` a zero-argument factory of an ``openenv.core.env_server.interfaces.Environment``
  (or any object with the same ``reset``/``step``; their calls run in a worker thread), with ``action=`` the
  environment's Action class (built as ``Action(**{action_key: reply})``);
- **over its WebSocket**: ``url=`` a server made by ``openenv``'s ``create_app`` (``/ws``; OpenEnv's HTTP
  ``/reset`` and ``/step`` are stateless, so episodes must use the socket), through ``GenericEnvClient``.

A task is a seed: ``make`` resets an environment with a seed drawn from the engine's generator and takes the
observation's text as the prompt; the spec carries the seed, so the verifier (one turn: reset, one step) or
the episode (several turns: reset, then one step per model reply, each observation handed back as the next
user turn) replays the same start. The facts are the summed step rewards, ``done`` and the turns; the
reward is the summed reward clipped to [0, 1] (``reward_scale`` divides it first). The environment is the
"sandbox" of such a domain: nothing of the model's runs on the host, so ``needs_sandbox`` is False.

What a ``verifiers`` taskset would need to run the same way (not built): a single-turn taskset whose
``@vf.reward`` functions read only ``task`` and the reply can be scored in process by building a ``Trace``
and awaiting ``task.score`` (a ``make`` over ``taskset.load()`` and a verifier around ``score``); anything
with a harness, tools or a runtime runs verifiers' own rollout loop (a ``uv`` script and a model
endpoint), which an engine domain would have to drive as an episode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import zlib
from collections.abc import Callable
from typing import Any

import anyio

from domains.base import HASH_BUCKETS, HELDOUT_BUCKETS, Domain, Facts, GeneratedTask, Spec

__all__ = ["OpenEnvEpisode", "openenv_domain"]

TEXT_KEYS = ("prompt", "text", "message", "question", "observation", "output", "content")
"""Observation fields taken as the text shown to the model, in this order (else the fields as JSON)."""
_NOT_TEXT = {"done", "reward", "metadata"}


def observation_text(obs: dict[str, Any], key: str | None = None) -> str:
    """The text of an observation: ``obs[key]``, else the first string among :data:`TEXT_KEYS`, else JSON."""
    if key is not None:
        if key not in obs:
            raise ValueError(f"observation has no field {key!r} (fields: {sorted(obs)})")
        return str(obs[key])
    for name in TEXT_KEYS:
        if isinstance(obs.get(name), str):
            return str(obs[name])
    return json.dumps({k: v for k, v in obs.items() if k not in _NOT_TEXT}, sort_keys=True, default=str)


def _as_dict(obs: Any) -> dict[str, Any]:
    if isinstance(obs, dict):
        return obs
    dump = getattr(obs, "model_dump", None)
    if callable(dump):
        return dict(dump())
    return dict(vars(obs))


class _Connection:
    """One environment session: reset and step, uniformly for in-process and WebSocket environments."""

    def __init__(self, env: Callable[[], Any] | None, url: str | None, action: Callable[..., Any] | None,
                 action_key: str) -> None:
        self._factory, self._url, self._action, self._key = env, url, action, action_key
        self._env: Any = None
        self._client: Any = None

    async def reset(self, seed: int) -> tuple[dict[str, Any], float, bool]:
        if self._url is not None:
            from openenv.core.generic_client import GenericEnvClient  # type: ignore[import-not-found]  # optional

            self._client = GenericEnvClient(base_url=self._url)
            await self._client.__aenter__()
            result = await self._client.reset(seed=seed)
            return _as_dict(result.observation), float(result.reward or 0.0), bool(result.done)
        assert self._factory is not None
        self._env = self._factory()
        obs = _as_dict(await anyio.to_thread.run_sync(lambda: self._env.reset(seed=seed)))
        return obs, float(obs.get("reward") or 0.0), bool(obs.get("done"))

    async def step(self, reply: str) -> tuple[dict[str, Any], float, bool]:
        payload = {self._key: reply}
        if self._client is not None:
            result = await self._client.step(payload)
            return _as_dict(result.observation), float(result.reward or 0.0), bool(result.done)
        action = self._action(**payload) if self._action is not None else payload
        obs = _as_dict(await anyio.to_thread.run_sync(lambda: self._env.step(action)))
        return obs, float(obs.get("reward") or 0.0), bool(obs.get("done"))

    async def close(self) -> None:
        client, self._client = self._client, None
        env, self._env = self._env, None
        if client is not None:
            await client.__aexit__(None, None, None)
        close = getattr(env, "close", None)
        if callable(close):
            await anyio.to_thread.run_sync(close)


class OpenEnvEpisode:
    """A multi-turn episode of an OpenEnv environment (the interface the episode actor drives)."""

    def __init__(self, spec: Spec, connection: _Connection, observation_key: str | None) -> None:
        self.spec = spec
        self.max_turns = int(spec.get("max_turns", 1))
        self.turns = 0
        self.total = 0.0
        self.ended = False
        self._conn = connection
        self._key = observation_key

    async def open(self) -> None:
        _, reward, done = await self._conn.reset(int(self.spec["seed"]))
        self.total += reward
        self.ended = done

    @property
    def done(self) -> bool:
        return self.ended or self.turns >= self.max_turns

    async def step(self, command: str) -> str:
        if self.done:
            return f"[episode over: {'the environment ended it' if self.ended else f'max_turns={self.max_turns}'}]"
        self.turns += 1
        obs, reward, done = await self._conn.step(command)
        self.total += reward
        self.ended = done
        return observation_text(obs, self._key)

    async def finish(self) -> Facts:
        try:
            return {"reward": self.total, "done": self.ended, "turns": self.turns}
        finally:
            await self._conn.close()

    async def abandon(self) -> None:
        await self._conn.close()


def openenv_domain(name: str, *, env: Callable[[], Any] | None = None, url: str | None = None,
                   action: Callable[..., Any] | None = None, action_key: str = "message",
                   observation_key: str | None = None, max_turns: int = 1, max_new_tokens: int = 64,
                   reward_scale: float = 1.0, description: str = "") -> Domain:
    """A domain whose tasks are seeded resets of an OpenEnv environment (see the module docstring)."""
    if (env is None) == (url is None):
        raise ValueError(f"openenv domain {name!r}: give exactly one of env= (a factory) and url= (a WebSocket server)")
    if reward_scale <= 0:
        raise ValueError(f"openenv domain {name!r}: reward_scale must be positive, got {reward_scale}")

    def connect() -> _Connection:
        return _Connection(env, url, action, action_key)

    def make(rng: random.Random, difficulty: float) -> GeneratedTask:
        seed = rng.randrange(2 ** 31)

        async def first() -> dict[str, Any]:
            conn = connect()
            try:
                return (await conn.reset(seed))[0]
            finally:
                await conn.close()

        # make() is synchronous and may be called from a running event loop (the scheduler's): the reset
        # runs on a loop of its own in a worker thread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            obs = pool.submit(asyncio.run, first()).result()
        prompt = observation_text(obs, observation_key)
        return GeneratedTask(prompt=prompt, spec={"seed": seed, "max_turns": max_turns}, ideal="")

    async def verify(text: str, spec: Spec, pool: object) -> Facts:
        episode = OpenEnvEpisode(dict(spec, max_turns=1), connect(), observation_key)
        await episode.open()
        try:
            await episode.step(text)
        finally:
            facts = await episode.finish()
        return facts

    def reward(facts: Facts, text: str) -> float:
        return min(1.0, max(0.0, float(facts.get("reward", 0.0)) / reward_scale))

    def heldout(task: GeneratedTask) -> bool:  # the start observation may not vary: split by seed
        return zlib.crc32(f"seed:{task.spec['seed']}".encode()) % HASH_BUCKETS < HELDOUT_BUCKETS

    return Domain(name, verify, make, reward, lambda text: 1.0 if text.strip() else 0.0, max_turns=max_turns,
                  stop=(), max_new_tokens=max_new_tokens, episode="shell" if max_turns > 1 else "single",
                  episode_factory=lambda spec, _pool: OpenEnvEpisode(spec, connect(), observation_key),
                  heldout_split=heldout, sandbox=False, source=f"openenv {'ws ' + url if url else 'in process'}",
                  description=description or "an OpenEnv environment", tags=frozenset({"chat", "openenv"}))
