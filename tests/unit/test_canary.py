"""The weights canary: a server that reports a version without serving its weights trips it.

The local server runs in this process (tiny model, re-scoring on); the learner trains a step, and the
update is blocked: the server is told the new version number (``/update_weight_version``) but keeps its
old weights. The probe's log-probs then differ from the learner's under that version and the canary trips;
with the update applied (``/update_weights_from_disk``) it passes with a gap of at most 1e-6.

Against a bf16 server the canary compares weights exactly (``/get_weights_by_name``): the same blocked update
trips it naming the parameter, index and values; an applied one passes; a server without the endpoint gets
the log-prob probe, said once in the log. The local server's endpoint and the pure judge are tested here too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from actors.learner import WeightsCheck, probe_server, save_weights
from engine.config import LearnerConfig
from engine.schemas import Experience
from learning import canary
from learning.core import Learner, score_tokens
from modelserver.client import SGLangClient, SGLangHTTPError
from modelserver.llm import load_model_dir, write_tiny_model_dir
from modelserver.local.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(120)

CFG = LearnerConfig(batch_size=2, lr=0.05, canary_threshold=1e-3, canary_max_lag_s=30.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _serve(model_dir: str, dtype: str = "fp32", app_hook: Any = None) -> AsyncIterator[str]:
    app = build_app(ServerConfig(model_dir=model_dir, max_batch=4, chunk_size=64, weight_version="0", dtype=dtype,
                                 rescore=score_tokens))
    if app_hook is not None:
        app_hook(app)
    server = TestServer(app, port=0)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    client = SGLangClient([url])
    try:
        await client.wait_healthy(timeout=60)
        yield url
    finally:
        await client.aclose()
        await server.close()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(model directory, URL) of a re-scoring local server at weight version 0."""
    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    async for url in _serve(model_dir):
        yield model_dir, url


@pytest.fixture
async def served_bf16(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(model directory, URL) of a bf16 local server at weight version 0 (fp32 model directory)."""
    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    async for url in _serve(model_dir, "bf16"):
        yield model_dir, url


async def _hide_weights_endpoint(request: web.Request, handler: Any) -> web.StreamResponse:
    """An SGLang without ``/get_weights_by_name``: 404 there, as FastAPI answers an unknown path."""
    if request.path == "/get_weights_by_name":
        return web.json_response({"detail": "Not Found"}, status=404)
    return await handler(request)  # type: ignore[no-any-return]


@pytest.fixture
async def served_bf16_without_endpoint(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    async for url in _serve(model_dir, "bf16", lambda app: app.middlewares.append(web.middleware(_hide_weights_endpoint))):
        yield model_dir, url


def _train_one_step(learner: Learner) -> None:
    """One real optimizer step and the publication that follows it (version 0 -> 1)."""
    rng = np.random.default_rng(0)
    for i in range(CFG.batch_size):
        n = 6
        learner.offer(Experience(sample_id=f"s{i}", task_id="t", domain="d",
                                 prompt_ids=np.asarray([5, 6, 7], np.int32),
                                 response_ids=rng.integers(10, 60, size=n).astype(np.int32),
                                 logprobs=np.full(n, -3.0, np.float32), loss_mask=np.ones(n, np.uint8),
                                 weight_versions=np.zeros(n, np.int32), reward=1.0, advantage=1.0 - 2 * i,
                                 group_size=2))
    report = learner.step()
    assert report.publish and learner.version == 1


async def _probe(url: str, learner: Learner, tokenizer: Any, published_at: dict[int, float]) -> canary.Verdict:
    return await probe_server(url, learner, tokenizer, CFG, published_at)


@pytest.mark.anyio
async def test_canary_passes_when_the_server_serves_the_learners_weights(served, tmp_path: Path) -> None:
    model_dir, url = served
    model, tokenizer = load_model_dir(model_dir)
    learner = Learner(model, CFG, max_staleness=4)
    before = await _probe(url, learner, tokenizer, {0: 0.0})
    assert before.ok and before.compared and before.gap is not None and before.gap <= 1e-6, before
    _train_one_step(learner)
    save_weights(learner.model, tmp_path / "v1", tokenizer=tokenizer)
    client = SGLangClient([url])
    try:
        await client.update_weights_from_disk(str(tmp_path / "v1"), weight_version="1")
    finally:
        await client.aclose()
    after = await _probe(url, learner, tokenizer, {1: 0.0})
    assert after.ok and after.compared and after.gap is not None and after.gap <= 1e-6, after


@pytest.mark.anyio
async def test_canary_trips_when_a_weight_update_is_blocked(served) -> None:
    model_dir, url = served
    model, tokenizer = load_model_dir(model_dir)
    learner = Learner(model, CFG, max_staleness=4)
    _train_one_step(learner)
    client = SGLangClient([url])
    try:  # the update is blocked: the server reports version 1 and keeps version 0's weights
        await client.update_weight_version("1")
    finally:
        await client.aclose()
    verdict = await _probe(url, learner, tokenizer, {1: 0.0})
    assert not verdict.ok and verdict.compared, verdict
    assert verdict.gap is not None and verdict.gap > CFG.canary_threshold
    assert "claims weight version 1 but its probe log-probs differ" in verdict.reason


def test_a_server_that_never_catches_up_trips_after_the_lag_bound() -> None:
    common: dict[str, Any] = dict(url="u", learner_version=3, comparable=False, server_logprobs=[-1.0],
                                  learner_logprobs=None, threshold=1e-3, max_lag_s=30.0)
    assert canary.judge(claimed=2, lag_s=5.0, **common).ok  # still catching up
    late = canary.judge(claimed=2, lag_s=31.0, **common)
    assert not late.ok and "still serves weight version 2 31s after version 3" in late.reason
    assert not canary.judge(claimed=4, lag_s=None, **common).ok  # a version never published


def test_the_gap_is_relative_to_the_logprob() -> None:
    assert canary.relative_gap([-10.0], [-10.00001]) == pytest.approx(1e-6, rel=1e-3)
    assert canary.relative_gap([-0.5], [-0.5000005]) == pytest.approx(5e-7, rel=1e-3)
    assert canary.relative_gap([-1.0, -2.0], [-1.0]) == float("inf")


@pytest.mark.anyio
async def test_the_learner_role_says_so_loudly_and_stops_when_configured(served, caplog) -> None:
    """The role's canary after a publication: error log, counters, status, and with ``canary_action = "stop"``
    the learner fails (CanaryTripped)."""
    import json

    from actors.learner import CanaryTripped, LearnerActor
    from actors.runtime import Runtime
    from engine.config import EngineConfig, TransportConfig
    from engine.topics import Names

    model_dir, url = served
    model, tokenizer = load_model_dir(model_dir)
    cfg = EngineConfig(transport=TransportConfig(type="memory"),
                       learner=CFG.model_copy(update={"canary_action": "stop"}))
    async with Runtime(cfg, instance="canary") as rt:
        actor = LearnerActor(rt, model_dir, probe_urls=[url])
        actor.learner, actor.tokenizer = Learner(model, cfg.learner, max_staleness=4), tokenizer
        _train_one_step(actor.learner)
        actor._published_at[1] = 0.0
        client = SGLangClient([url])
        try:
            await client.update_weight_version("1")  # blocked: the old weights stay
        finally:
            await client.aclose()
        try:
            with pytest.raises(CanaryTripped, match="claims weight version 1"):
                await actor._canary()
        finally:
            await actor.teardown()  # closes the canary's client, kept between probes
        assert actor.canary_trips == 1 and actor.statistics()["canary_trips"] == 1
        assert any("CANARY TRIPPED" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
        status = json.loads(await rt.require_control().kv_get(rt.kv_bucket, Names.LEARNER_VERSION_KEY) or b"{}")
        assert status["canary"]["trips"] == 1 and "claims weight version 1" in status["canary"]["tripped"]


# -- the exact check against bf16 servers (/get_weights_by_name) ---------------------------------------------

NORM = "model.norm.weight"
DOWN0 = "model.layers.0.mlp.down_proj.weight"


def _bf16_neighbour(x: float) -> float:
    """The next bf16 value above ``x`` (one unit in the last place)."""
    bits = torch.tensor([x], dtype=torch.bfloat16).view(torch.int16) + 1
    return float(bits.view(torch.bfloat16).float())


def _tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config

    return build_tiny_model(tiny_config(len(build_char_tokenizer())), seed=seed).state_dict()


def _expected(state: dict[str, torch.Tensor], publish: str = "float32") -> dict[str, list[Any]]:
    plan = canary.weight_plan(canary.default_weight_names(2), {k: tuple(v.shape) for k, v in state.items()})
    return {name: canary.served_values(state[name], rows, publish, "bf16") for name, rows in plan.items()}


def test_the_plan_asks_whole_leading_rows_and_refuses_unknown_names() -> None:
    state = _tiny_state()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    # down_proj [128, 256]: one whole row; the norm [128]: all of it (under WEIGHT_VALUES)
    assert canary.weight_plan(canary.default_weight_names(2), shapes) == {
        DOWN0: 1, "model.layers.1.mlp.down_proj.weight": 1, NORM: 128}
    assert canary.weight_plan(["x"], {"x": (64, 16)}) == {"x": canary.WEIGHT_VALUES // 16}
    with pytest.raises(ValueError, match=r"\['model.layers.9.mlp.down_proj.weight'\] not parameters"):
        canary.weight_plan(["model.layers.9.mlp.down_proj.weight", NORM], shapes)
    with pytest.raises(ValidationError, match="an empty list compares nothing"):
        LearnerConfig(canary_weights=[])


def test_an_exact_match_passes_and_fp32_values_rounding_to_the_same_bf16_pass() -> None:
    state = _tiny_state()
    expected = _expected(state)
    verdict = canary.judge_weights(url="u", claimed=3, expected=expected, served=expected)
    assert verdict.ok and verdict.exact and verdict.compared and "640 values of 3 parameters" in verdict.reason
    # the server's fp32 source differs from the learner's (one float32 ulp) but rounds to the same bf16
    nudged = {k: torch.nextafter(v, torch.full_like(v, float("inf"))) for k, v in state.items()}
    assert not torch.equal(nudged[DOWN0], state[DOWN0])
    assert torch.equal(nudged[DOWN0].bfloat16(), state[DOWN0].bfloat16())
    assert canary.judge_weights(url="u", claimed=3, expected=expected, served=_expected(nudged)).ok
    # a bf16 wire (publish_dtype = "bfloat16") rounds once more to the same values
    assert _expected(state, "bfloat16") == expected
    # several data-parallel ranks: one list each, every one compared
    assert canary.judge_weights(url="u", claimed=3, expected=expected,
                                served={k: [v, v] for k, v in expected.items()}).ok


def test_one_flipped_bf16_value_trips_naming_the_parameter_index_and_values() -> None:
    expected = _expected(_tiny_state())
    served = {k: [list(row) if isinstance(row, list) else row for row in v] for k, v in expected.items()}
    old = served[DOWN0][0][17]
    served[DOWN0][0][17] = _bf16_neighbour(old)
    verdict = canary.judge_weights(url="u", claimed=3, expected=expected, served=served,
                                   cast="float32 -> float32 -> bf16")
    assert not verdict.ok and verdict.exact and verdict.compared
    assert (f"claims weight version 3 but serves {DOWN0}[0, 17] = {served[DOWN0][0][17]!r} where the learner's "
            f"value (cast float32 -> float32 -> bf16 as the server loaded it) is {old!r}") in verdict.reason
    ranks = canary.judge_weights(url="u", claimed=3, expected=expected,
                                 served={k: [expected[k], served[k]] for k in expected})
    assert not ranks.ok and f"{DOWN0}[0, 17]" in ranks.reason and "(data-parallel rank 1)" in ranks.reason
    flat = {k: list(np.ravel(v)) for k, v in expected.items()}  # not SGLang's shape (it slices rows)
    shaped = canary.judge_weights(url="u", claimed=3, expected=expected, served=flat)
    assert not shaped.ok and f"answers {DOWN0} with shape [256] where the learner's leading values have [1, 256]" in shaped.reason


def test_the_previous_versions_weights_trip_even_after_a_small_update() -> None:
    """A server that kept version n-1: an Adam-sized step (1e-4 per weight, sign-like) moves enough bf16 values."""
    old = _tiny_state()
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 1e-4 * torch.sign(torch.randn(v.shape, generator=gen)) for k, v in old.items()}
    verdict = canary.judge_weights(url="u", claimed=4, expected=_expected(new), served=_expected(old))
    assert not verdict.ok and f"claims weight version 4 but serves {DOWN0}[0, " in verdict.reason


@pytest.mark.anyio
async def test_the_local_servers_get_weights_by_name(served_bf16) -> None:
    """SGLang's request and answer: leading rows of the parameter in the served dtype (bf16 here), GET or POST;
    a bad name or truncate_size is a 400 naming the parameter."""
    import aiohttp

    model_dir, url = served_bf16
    model, _ = load_model_dir(model_dir)
    state = model.state_dict()
    want = state[DOWN0][:2].bfloat16().float().tolist()
    assert want != state[DOWN0][:2].tolist()  # bf16 values, not the file's fp32 ones
    async with SGLangClient([url], retries=0) as client:
        assert await client.get_weights_by_name(DOWN0, 2) == want
        assert await client.get_weights_by_name(NORM, 5) == state[NORM][:5].bfloat16().float().tolist()
        assert await client.get_weights_by_name(DOWN0, 1) == canary.served_values(state[DOWN0], 1, "float32", "bf16")
        with pytest.raises(SGLangHTTPError) as info:
            await client.get_weights_by_name("model.layers.7.mlp.down_proj.weight")
        assert info.value.status == 400 and "'model.layers.7.mlp.down_proj.weight'" in info.value.message
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/get_weights_by_name", json={"name": NORM}) as resp:  # default truncate_size 100
            assert resp.status == 200 and await resp.json() == state[NORM][:100].bfloat16().float().tolist()
        for body in ({"name": NORM, "truncate_size": -1}, {"name": NORM, "truncate_size": "3"},
                     {"name": NORM, "truncate_size": True}):
            async with http.post(url + "/get_weights_by_name", json=body) as resp:
                assert resp.status == 400 and NORM in (await resp.json())["error"]["message"], body
        async with http.post(url + "/get_weights_by_name", json={"truncate_size": 3}) as resp:
            assert resp.status == 400 and "name" in (await resp.json())["error"]["message"]


@pytest.mark.anyio
async def test_the_exact_canary_trips_on_a_blocked_update_and_passes_an_applied_one(served_bf16, tmp_path: Path) -> None:
    model_dir, url = served_bf16
    model, tokenizer = load_model_dir(model_dir)
    learner = Learner(model, CFG, max_staleness=4)
    check = WeightsCheck(CFG, "bf16")

    async def probe() -> canary.Verdict:
        return await probe_server(url, learner, tokenizer, CFG, {1: 0.0}, serving_dtype="bf16", weights_check=check)

    client = SGLangClient([url])

    async def finished() -> int:
        return int((await client.server_info())["internal_states"][0]["finished"])

    try:
        generated = await finished()
        before = await probe()
        assert before.ok and before.exact and before.compared and before.gap is None, before
        assert await finished() == generated  # the exact check reads the version and weights: nothing generated
        _train_one_step(learner)
        await client.update_weight_version("1")  # blocked: the server claims version 1 and keeps version 0's weights
        blocked = await probe()
        assert not blocked.ok and blocked.exact, blocked
        assert f"claims weight version 1 but serves {DOWN0}[0, " in blocked.reason
        assert "cast float32 -> float32 -> bf16" in blocked.reason
        # the update applied; a bf16 wire (publish_dtype) gives a bf16 server the same values as a float32 one
        for wire in ("float32", "bfloat16"):
            save_weights(learner.model, tmp_path / wire, wire, tokenizer=tokenizer)
            await client.update_weights_from_disk(str(tmp_path / wire), weight_version="1")
            after = await probe()
            assert after.ok and after.exact, (wire, after)
    finally:
        await client.aclose()
    assert not check.unavailable


@pytest.mark.anyio
async def test_a_bf16_server_without_the_endpoint_gets_the_logprob_probe_said_once(served_bf16_without_endpoint,
                                                                                   caplog) -> None:
    model_dir, url = served_bf16_without_endpoint
    model, tokenizer = load_model_dir(model_dir)
    learner = Learner(model, CFG, max_staleness=4)
    check = WeightsCheck(CFG, "bf16")
    for _ in range(2):
        verdict = await probe_server(url, learner, tokenizer, CFG, {}, serving_dtype="bf16", weights_check=check)
        # the log-prob probe at the bf16 floor: bf16 rounding alone stays under it
        assert verdict.ok and verdict.compared and not verdict.exact and verdict.gap is not None, verdict
        assert verdict.gap <= canary.BF16_SERVING_FLOOR
    assert check.unavailable == {url}
    said = [r for r in caplog.records if "cannot answer /get_weights_by_name" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING" and "HTTP 404" in said[0].getMessage()


@pytest.mark.anyio
async def test_a_client_kept_between_probes_asks_an_upstream_sglang_for_the_version_endpoint_once(tmp_path: Path) -> None:
    """Upstream SGLang v0.5.15 answers ``/get_weight_version`` 404 and serves the version in ``/model_info``;
    the learner keeps one client per server between probes, so that 404 comes once, not once per probe."""
    asked: list[str] = []

    async def upstream(request: web.Request, handler: Any) -> web.StreamResponse:
        asked.append(request.path)
        if request.path == "/get_weight_version":
            return web.json_response({"detail": "Not Found"}, status=404)
        return await handler(request)  # type: ignore[no-any-return]

    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    model, tokenizer = load_model_dir(model_dir)
    learner = Learner(model, CFG, max_staleness=4)
    check = WeightsCheck(CFG, "bf16")
    async for url in _serve(model_dir, "bf16", lambda app: app.middlewares.append(web.middleware(upstream))):
        async with SGLangClient([url]) as client:
            for _ in range(3):
                verdict = await probe_server(url, learner, tokenizer, CFG, {}, serving_dtype="bf16",
                                             weights_check=check, client=client)
                assert verdict.ok and verdict.exact, verdict
            assert await client.get_weight_version(url) == "0"  # the caller's client: the probes left it open
    assert asked.count("/get_weight_version") == 1 and asked.count("/model_info") == 4, asked


@pytest.mark.anyio
async def test_the_learner_refuses_to_start_with_canary_weights_its_model_lacks(tmp_path: Path) -> None:
    from actors.learner import LearnerActor
    from actors.runtime import Runtime
    from engine.config import EngineConfig, InferenceConfig, TransportConfig

    model_dir = str(write_tiny_model_dir(tmp_path / "model", seed=0))
    cfg = EngineConfig(transport=TransportConfig(type="memory"), inference=InferenceConfig(dtype="bf16"),
                       learner=CFG.model_copy(update={"checkpoint_dir": str(tmp_path / "ckpt"),
                                                      "canary_weights": [NORM, "model.layers.5.mlp.down_proj.weight"]}))
    threads = torch.get_num_threads()  # setup sets learner.torch_threads for the process
    try:
        async with Runtime(cfg, instance="canary-names") as rt:
            actor = LearnerActor(rt, model_dir, probe_urls=["http://127.0.0.1:9"])
            with pytest.raises(ValueError, match=r"learner.canary_weights: \['model.layers.5.mlp.down_proj.weight'\] "
                                                 "not parameters of the learner's model"):
                await actor.setup()
    finally:
        torch.set_num_threads(threads)
