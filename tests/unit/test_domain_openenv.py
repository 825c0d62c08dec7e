"""domains/openenv.py: an OpenEnv-style environment (reset/step observations with done and reward) as a
domain, single- and multi-turn. The environment here is a small one written against OpenEnv's interface
(pydantic Action/Observation, ``reset(seed=)``, ``step(action)``); the adapter sits above that interface."""

from __future__ import annotations

import random

import anyio
import pytest
from pydantic import BaseModel

from domains.openenv import observation_text, openenv_domain


class GuessAction(BaseModel):
    message: str


class GuessObservation(BaseModel):
    prompt: str
    done: bool = False
    reward: float | None = None


class GuessEnv:
    """Guess a number in 1..8 from the seed; each wrong guess is told higher/lower, a right one ends it."""

    closed = 0

    def reset(self, seed: int | None = None) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, 8)
        return GuessObservation(prompt="Guess my number between 1 and 8. Reply with the number only.")

    def step(self, action: GuessAction) -> GuessObservation:
        guess = int(action.message.strip()) if action.message.strip().isdigit() else -1
        if guess == self.secret:
            return GuessObservation(prompt="right", done=True, reward=1.0)
        return GuessObservation(prompt="higher" if guess < self.secret else "lower", reward=0.0)

    def close(self) -> None:
        GuessEnv.closed += 1


def test_single_turn_tasks_are_seeded_resets_scored_by_the_environment() -> None:
    domain = openenv_domain("guess1", env=GuessEnv, action=GuessAction)
    assert not domain.needs_sandbox and domain.episode_kind == "single"
    prompt, spec = domain.generate(random.Random(1))
    assert prompt.startswith("Guess my number") and isinstance(spec["seed"], int)
    secret = random.Random(spec["seed"]).randint(1, 8)
    right = anyio.run(domain.verify, str(secret), spec, None)
    wrong = anyio.run(domain.verify, str(secret % 8 + 1), spec, None)
    assert right == {"reward": 1.0, "done": True, "turns": 1} and domain.reward(right, "") == 1.0
    assert wrong["reward"] == 0.0 and not wrong["done"] and domain.reward(wrong, "") == 0.0


def test_multi_turn_episode_hands_observations_back_and_sums_rewards() -> None:
    domain = openenv_domain("guess3", env=GuessEnv, action=GuessAction, max_turns=4)
    assert domain.multi_turn and domain.turns({"max_turns": 4}) == 4
    _, spec = domain.generate(random.Random(2))
    secret = random.Random(spec["seed"]).randint(1, 8)
    closed = GuessEnv.closed

    async def play() -> tuple[list[str], dict]:
        episode = domain.new_episode(spec, None)
        await episode.open()
        seen = [await episode.step("0"), await episode.step("9")]
        seen.append(await episode.step(str(secret)))
        assert episode.done
        seen.append(await episode.step("1"))  # past the end: nothing runs
        return seen, await episode.finish()

    seen, facts = anyio.run(play)
    assert seen[:3] == ["higher", "lower", "right"] and seen[3].startswith("[episode over")
    assert facts == {"reward": 1.0, "done": True, "turns": 3} and GuessEnv.closed == closed + 1


def test_bad_arguments_and_observation_fields_are_named() -> None:
    with pytest.raises(ValueError, match="exactly one of env="):
        openenv_domain("x")
    with pytest.raises(ValueError, match="reward_scale must be positive"):
        openenv_domain("x", env=GuessEnv, reward_scale=0)
    assert observation_text({"board": [1, 2], "done": False, "reward": 0}) == '{"board": [1, 2]}'
    with pytest.raises(ValueError, match="observation has no field 'text'"):
        observation_text({"prompt": "p"}, "text")
