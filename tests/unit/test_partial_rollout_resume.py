"""A generation a weight update aborts is resumed with its tokens kept, also when it began after the update
started (its epoch already bumped) and was aborted by it: before, such a sample ended as "abort", short. One
aborted just as its budget ran out is whole: it ends as "length" (before, "abort" with every token)."""

from __future__ import annotations

import types
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.inference.actor import InferenceActor, _Sample
from actors.runtime import Runtime
from engine.config import EngineConfig, InferenceConfig, TransportConfig
from engine.schemas import Task
from modelserver.client import GenerateResult
from modelserver.llm import build_char_tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _result(ids: list[int], finish: str | None, version: str) -> GenerateResult:
    return GenerateResult(text="", output_ids=ids, logprobs=[-0.5] * len(ids),
                          finish_reason=None if finish is None else {"type": finish}, weight_version=version,
                          prompt_tokens=3, completion_tokens=len(ids), token_weight_versions=None)


class AbortOnce:
    """A server whose first request is aborted after 2 tokens (by a weight update, say); later ones run out
    their budget. ``during`` runs between the request's start and its abort."""

    def __init__(self, during: Any = None) -> None:
        self.requests: list[int] = []
        self.during = during

    async def generate_stream(self, input_ids: list[int], *, sampling_params: dict[str, Any], rid: str,
                              key: str) -> AsyncIterator[GenerateResult]:
        budget = int(sampling_params["max_new_tokens"])
        self.requests.append(budget)
        if len(self.requests) == 1:
            if self.during is not None:
                self.during()
            yield _result([5, 6], "abort", "0")
            return
        yield _result(list(range(7, 7 + budget)), "length", "1")


async def _generate(actor: InferenceActor, client: AbortOnce, budget: int = 6) -> tuple[str, _Sample]:
    actor.client = client  # type: ignore[assignment]
    task = Task(task_id="t", domain="arith", prompt="1+1=", spec={"answer": "2"}, group_size=1)
    sample = _Sample("t/0")
    record = types.SimpleNamespace(traceparent=None)
    finish = await actor._generate(record, task, sample, [1, 2, 3],  # type: ignore[arg-type]
                                   {"max_new_tokens": budget, "temperature": 1.0}, budget)
    return finish, sample


async def test_an_abort_from_an_update_that_began_before_the_request_is_resumed_not_kept_short() -> None:
    cfg = EngineConfig(namespace="resume", transport=TransportConfig(type="memory"),
                       inference=InferenceConfig(partial_rollouts=True))
    async with Runtime(cfg, instance="one", use_nats=False) as rt:
        actor = InferenceActor(rt, ["http://127.0.0.1:1"], build_char_tokenizer())
        # the update is in flight when the request starts (its epoch is already the bumped one) and aborts it
        with actor._weights_swap():
            client = AbortOnce()
            finish, sample = await _generate(actor, client)
        assert finish == "length" and client.requests == [6, 4]  # resumed for the 4 tokens left
        assert sample.ids == [5, 6, 7, 8, 9, 10]

        # the abort arrives after the update returned: the second bump tells it apart
        swap = actor._weights_swap()
        swap.__enter__()
        client = AbortOnce(during=lambda: swap.__exit__(None, None, None))
        finish, sample = await _generate(actor, client)
        assert finish == "length" and client.requests == [6, 4] and len(sample.ids) == 6

        # no update anywhere near it: an abort is the generation's end
        finish, sample = await _generate(actor, AbortOnce())
        assert finish == "abort" and sample.ids == [5, 6]


class AbortAtBudget:
    """A server whose request is aborted (by a weight update) after its last token: the whole budget is there."""

    def __init__(self) -> None:
        self.requests: list[int] = []

    async def generate_stream(self, input_ids: list[int], *, sampling_params: dict[str, Any], rid: str,
                              key: str) -> AsyncIterator[GenerateResult]:
        budget = int(sampling_params["max_new_tokens"])
        self.requests.append(budget)
        yield _result(list(range(5, 5 + budget)), None, "0")
        yield GenerateResult(text="", output_ids=list(range(5, 5 + budget)), logprobs=[-9.0] * budget,
                             finish_reason={"type": "abort"}, weight_version="0", prompt_tokens=3,
                             completion_tokens=budget, token_weight_versions=None)


async def test_an_abort_after_the_last_token_is_a_whole_sample_not_an_abort() -> None:
    cfg = EngineConfig(namespace="resume", transport=TransportConfig(type="memory"),
                       inference=InferenceConfig(partial_rollouts=True))
    async with Runtime(cfg, instance="one", use_nats=False) as rt:
        actor = InferenceActor(rt, ["http://127.0.0.1:1"], build_char_tokenizer())
        for during_update in (True, False):
            client = AbortAtBudget()
            if during_update:
                with actor._weights_swap():
                    finish, sample = await _generate(actor, client)
            else:
                finish, sample = await _generate(actor, client)
            assert finish == "length" and client.requests == [6], during_update  # not resumed: nothing left
            assert sample.ids == [5, 6, 7, 8, 9, 10]
            assert sample.logprobs == [-0.5] * 6  # as streamed: an aborted chunk's logprobs are not re-scored ones
