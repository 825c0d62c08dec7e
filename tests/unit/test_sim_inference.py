"""The simulated inference backend: roofline formulas and the SGLang HTTP protocol over a SimEngine."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from modelserver.local.server import ServerConfig
from modelserver.sim.roofline import SMOLLM2_135M, Hardware, LengthModel, ModelShape, Roofline
from modelserver.sim.server import SimOptions, build_sim_app


def test_roofline_formulas_follow_the_documented_model() -> None:
    hw = Hardware(peak_flops=1e15, hbm_bytes_per_s=2e12, mfu=0.5, bw_efficiency=0.5, step_overhead_s=0.0, update_bytes_per_s=1e10)
    model = ModelShape(params=1e9, bytes_per_param=2, layers=10, kv_heads=2, head_dim=64, kv_bytes_per_elem=2)
    r = Roofline(hw, model)
    assert r.prefill_s(1000) == pytest.approx(2 * 1e9 * 1000 / 5e14)
    assert model.kv_bytes_per_token == 2 * 10 * 2 * 64 * 2
    assert r.decode_step_s(0) == pytest.approx(2e9 / 1e12)
    assert r.decode_step_s(1000) > r.decode_step_s(0)  # KV traffic grows with the batch's cache
    assert r.weight_update_s() == pytest.approx(2e9 / 1e10)
    assert r.learner_step_s(1000, n_gpus=4) == pytest.approx(r.learner_step_s(1000) / 4)
    assert r.describe()["simulated"] is True
    with pytest.raises(ValueError, match="n_gpus"):
        r.learner_step_s(10, n_gpus=0)
    assert SMOLLM2_135M.weight_bytes < ModelShape().weight_bytes


def test_length_model_is_long_tailed_and_capped() -> None:
    lengths = LengthModel(median=1000, sigma=1.0, max_tokens=8000)
    rng = random.Random(1)
    xs = sorted(lengths.sample(rng) for _ in range(5000))
    mean, median = sum(xs) / len(xs), xs[len(xs) // 2]
    assert mean > 1.3 * median  # right-skewed
    assert max(xs) == 8000 and min(xs) >= 1


def _run(coro_fn, options: SimOptions, **cfg) -> None:
    async def main() -> None:
        server = TestServer(build_sim_app(ServerConfig(port=0, **cfg), options), host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession(str(server.make_url(""))) as http:
                await coro_fn(http)
        finally:
            await server.close()

    asyncio.run(main())


FAST = SimOptions(time_scale=0.0, lengths=LengthModel(median=50, sigma=0.1, max_tokens=200))


def test_generate_returns_synthetic_tokens_and_labelled_model_info() -> None:
    async def body(http: aiohttp.ClientSession) -> None:
        async with http.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}) as r:
            out = await r.json()
        assert r.status == 200, out
        assert out["meta_info"]["completion_tokens"] == 8
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(out["meta_info"]["output_token_logprobs"]) == 8
        async with http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000}}) as r:
            out = await r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop"  # the sampled length, under the cap
        assert 30 <= out["meta_info"]["completion_tokens"] <= 200
        async with http.get("/get_model_info") as r:
            info = await r.json()
        assert info["model_type"] == "simulated"
        async with http.post("/flush_cache") as r:  # nothing cached, nothing running: SGLang's 200 text
            assert r.status == 200 and (await r.text()).startswith("Cache flushed.")

    _run(body, FAST)


def test_streaming_yields_growing_chunks_then_done() -> None:
    async def body(http: aiohttp.ClientSession) -> None:
        chunks = []
        async with http.post("/generate", json={"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 5}}) as r:
            async for line in r.content:
                line = line.strip()
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    chunks.append(json.loads(line[5:]))
        assert chunks and chunks[-1]["meta_info"]["completion_tokens"] == 5
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    _run(body, SimOptions(time_scale=0.0, lengths=LengthModel(median=500, sigma=0.1)))


def test_weight_update_takes_simulated_time_and_sets_the_version() -> None:
    # time_scale 1.0 over a weight update of 0.05 simulated seconds: the request is held at least that long.
    opts = SimOptions(time_scale=1.0, roofline=Roofline(Hardware(update_bytes_per_s=SMOLLM2_135M.weight_bytes / 0.05), SMOLLM2_135M))

    async def body(http: aiohttp.ClientSession) -> None:
        start = time.monotonic()
        async with http.post("/update_weights_from_disk", json={"model_path": "/nonexistent/sim", "weight_version": "v7"}) as r:
            out = await r.json()
        held = time.monotonic() - start
        assert r.status == 200 and out["success"] is True, out
        assert held >= 0.05
        async with http.get("/get_weight_version") as r:
            assert (await r.json())["weight_version"] == "v7"

    _run(body, opts)


def test_pause_retract_keeps_partial_output_and_continue_resumes() -> None:
    opts = SimOptions(time_scale=1.0, lengths=LengthModel(median=10_000, sigma=0.01, max_tokens=20_000),
                      roofline=Roofline(Hardware(step_overhead_s=0.005), SMOLLM2_135M))

    async def body(http: aiohttp.ClientSession) -> None:
        gen = asyncio.create_task(http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 40}}))
        deadline = time.monotonic() + 10
        while True:  # wait until the request is running
            async with http.get("/server_info") as r:
                stats = (await r.json()).get("internal_states", [{}])[0]
            if stats.get("decode_tokens", 0) > 2:
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.01)
        async with http.post("/pause_generation", json={"mode": "retract"}) as r:
            assert r.status == 200
        async with http.post("/continue_generation", json={}) as r:
            assert r.status == 200
        resp = await asyncio.wait_for(gen, 20)
        out = await resp.json()
        assert out["meta_info"]["completion_tokens"] == 40
        assert out["meta_info"]["finish_reason"]["type"] == "length"

    _run(body, opts)


def test_calibration_fit_recovers_a_line_and_reports_its_error() -> None:
    from modelserver.sim.calibrate import _linear_fit, _rel_error

    xs = [32.0, 128.0, 256.0, 512.0]
    ys = [0.1 + 0.002 * x for x in xs]
    fit = _linear_fit(xs, ys)
    assert fit == pytest.approx((0.1, 0.002))
    assert _rel_error(xs, ys, fit) == pytest.approx(0.0, abs=1e-9)
    assert _rel_error(xs, [y * 1.2 for y in ys], fit) == pytest.approx(1 - 1 / 1.2)


def test_serve_sim_stops_with_a_clear_error_when_its_tokenizer_cannot_load(tmp_path) -> None:
    """The sim server shares the local server's start-up: a tokenizer that fails to load ends ``serve``
    with ModelLoadError (no server that answers 503 forever)."""
    from modelserver.local.server import ModelLoadError
    from modelserver.sim.server import serve_sim

    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    bound: list[int] = []

    async def main() -> None:
        await asyncio.wait_for(serve_sim(ServerConfig(model_dir=str(empty), port=0),
                                         on_bound=lambda host, port: bound.append(port)), 60)

    with pytest.raises(ModelLoadError, match="tokenizer load failed"):
        asyncio.run(main())
    assert bound and bound[0] > 0  # it listened first, then stopped
