"""Conformance of the `local` inference server with SGLang's native API, through SGLangClient.

The server runs as a real subprocess (`python -m ops.cli inference serve --port 0`): the test reads the
port from its first stdout line and waits until /health_generate answers 200. The model is a tiny seeded
Llama built into a temp dir, so logprobs can be recomputed in-process with the same weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from modelserver.client import (
    GenerateResult,
    SGLangClient,
    SGLangHTTPError,
    SGLangWeightUpdateError,
)
from modelserver.llm import load_model_dir, save_model_dir, write_tiny_model_dir
from engine.config import INFERENCE_API_KEY_ENV as API_KEY_ENV

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
GREEDY = {"temperature": 0.0}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ServerProcess:
    """A `rollout inference serve` subprocess on a free port."""

    def __init__(self, *args: str, env_extra: dict[str, str] | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop(API_KEY_ENV, None)
        env.update(env_extra or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "inference", "serve", "--port", "0", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            tail = self.stderr_tail()
            self.stop()
            raise RuntimeError(f"server exited before listening: {tail}")
        self.url = json.loads(line)["url"]

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.status("/health_generate") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.stderr_tail()
                self.stop()
                raise RuntimeError(f"server not ready: {tail}")
            time.sleep(0.05)  # poll interval, not a readiness guess

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The served model and a perturbed copy (same shapes, different weights) for weight updates."""
    base = write_tiny_model_dir(tmp_path_factory.mktemp("model"), seed=0)
    model, tokenizer = load_model_dir(base)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    perturbed = save_model_dir(model, tokenizer, tmp_path_factory.mktemp("model_v2"))
    return base, perturbed


@pytest.fixture(scope="module")
def server(model_dirs: tuple[Path, Path]) -> Iterator[ServerProcess]:
    proc = ServerProcess("--model-dir", str(model_dirs[0]), "--max-batch", "16", "--chunk-size", "16")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[SGLangClient]:
    async with SGLangClient([server.url], timeout=60, retries=1, backoff_s=0.05) as c:
        yield c


def _reference_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    model, _ = load_model_dir(model_dir)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


# ------------------------------------------------------------------------ generate


@pytest.mark.anyio
async def test_generate_response_shape(client: SGLangClient) -> None:
    result = await client.generate(text="def add(a, b):", sampling_params={"max_new_tokens": 5, **GREEDY}, rid="shape-1")
    meta = result.meta_info
    assert result.rid == "shape-1" and meta["id"] == "shape-1"
    assert result.finish_reason == {"type": "length", "length": 5}
    assert len(result.output_ids) == 5 == result.completion_tokens
    assert result.prompt_tokens == len("def add(a, b):")
    assert isinstance(result.text, str) and len(result.text) <= 5  # special tokens are skipped in text
    assert meta["weight_version"] == "default" and meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert [e[1] for e in meta["output_token_logprobs"]] == result.output_ids
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    assert result.token_weight_versions == ["default"] * 5


@pytest.mark.anyio
async def test_greedy_is_deterministic_and_logprobs_match_the_model(client: SGLangClient, model_dirs: tuple[Path, Path]) -> None:
    prompt = [5, 6, 7, 8, 40, 41, 42]
    params = {"max_new_tokens": 12, "ignore_eos": True, **GREEDY}
    first = await client.generate(prompt, sampling_params=params)
    second = await client.generate(prompt, sampling_params=params)
    # the second reuses the first's prompt from the prefix cache: its last prompt token runs in another
    # GEMM shape, so the logprobs agree to float rounding, not bit for bit
    assert second.meta_info["cached_tokens"] == len(prompt) - 1
    assert first.output_ids == second.output_ids and first.logprobs == pytest.approx(second.logprobs, abs=1e-5)
    assert first.logprobs is not None and all(lp <= 0.0 for lp in first.logprobs)
    reference = _reference_logprobs(model_dirs[0], prompt, first.output_ids)
    assert first.logprobs == pytest.approx(reference, abs=1e-4)


@pytest.mark.anyio
async def test_seeded_sampling_is_reproducible(client: SGLangClient) -> None:
    params = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "sampling_seed": 7, "ignore_eos": True}
    a = await client.generate(text="x = ", sampling_params=params)
    b = await client.generate(text="x = ", sampling_params=params)
    assert a.output_ids == b.output_ids


@pytest.mark.anyio
async def test_streaming_chunks_are_cumulative_and_terminated(server: ServerProcess) -> None:
    body = {"text": "for i in range(3):", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, **GREEDY}, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(server.url + "/generate", json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert len(chunks[-1]["output_ids"]) == 6


@pytest.mark.anyio
async def test_client_stream_matches_non_stream(client: SGLangClient) -> None:
    params = {"max_new_tokens": 8, "ignore_eos": True, **GREEDY}
    chunks = [c async for c in client.generate_stream(text="echo $HOME", sampling_params=params)]
    whole = await client.generate(text="echo $HOME", sampling_params=params)
    assert chunks[-1].output_ids == whole.output_ids and chunks[-1].text == whole.text
    assert chunks[-1].logprobs == pytest.approx(whole.logprobs)
    assert all(not c.finished for c in chunks[:-1]) and chunks[-1].finish_type == "length"


@pytest.mark.anyio
async def test_concurrent_requests_match_sequential(client: SGLangClient) -> None:
    prompts = [[10 + i, 20 + i, 30 + (i * 7) % 60] * (1 + i % 3) for i in range(10)]
    params = {"max_new_tokens": 10, "ignore_eos": True, **GREEDY}
    sequential = [await client.generate(p, sampling_params=params) for p in prompts]
    concurrent = await asyncio.gather(*(client.generate(p, sampling_params=params) for p in prompts))
    assert [r.output_ids for r in concurrent] == [r.output_ids for r in sequential]
    for c, s in zip(concurrent, sequential):
        assert c.logprobs == pytest.approx(s.logprobs, abs=1e-4)


@pytest.mark.anyio
async def test_batch_input_returns_a_list(server: ServerProcess) -> None:
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, **GREEDY}}
    async with aiohttp.ClientSession() as session, session.post(server.url + "/generate", json=body) as resp:
        out = await resp.json()
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 2]


@pytest.mark.anyio
async def test_stop_strings_and_stop_tokens(client: SGLangClient) -> None:
    params = {"max_new_tokens": 20, "ignore_eos": True, **GREEDY}
    free = await client.generate(text="print(1 + 2)", sampling_params=params)
    stop = free.text[4:6]
    cut = free.text.index(stop)
    stopped = await client.generate(text="print(1 + 2)", sampling_params={**params, "stop": [stop]})
    assert stopped.finish_reason == {"type": "stop", "matched": stop}
    assert stopped.text == free.text[:cut]
    stop_id = free.output_ids[3]
    by_token = await client.generate(text="print(1 + 2)", sampling_params={**params, "stop_token_ids": [stop_id]})
    first = free.output_ids.index(stop_id)
    assert by_token.finish_reason == {"type": "stop", "matched": stop_id}
    assert by_token.output_ids == free.output_ids[: first + 1]


# ------------------------------------------------------------------------ abort / pause


async def _long_stream(client: SGLangClient, rid: str, tokens: int = 400) -> list[GenerateResult]:
    params = {"max_new_tokens": tokens, "ignore_eos": True, **GREEDY}
    return [c async for c in client.generate_stream([5, 6, 7], sampling_params=params, rid=rid)]


async def _wait_tokens(client: SGLangClient, rid_results: list[GenerateResult], n: int) -> None:
    while not rid_results or len(rid_results[-1].output_ids) < n:
        await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_abort_returns_partial_output(client: SGLangClient) -> None:
    seen: list[GenerateResult] = []

    async def consume() -> None:
        params = {"max_new_tokens": 2000, "ignore_eos": True, **GREEDY}
        async for chunk in client.generate_stream([5, 6, 7], sampling_params=params, rid="abort-me-1"):
            seen.append(chunk)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(_wait_tokens(client, seen, 3), 30)
    await client.abort("abort-me")  # prefix match
    await asyncio.wait_for(task, 30)
    final = seen[-1]
    assert final.finish_type == "abort"
    assert 3 <= len(final.output_ids) < 2000 and len(final.logprobs or []) == len(final.output_ids)


@pytest.mark.anyio
async def test_generate_waits_while_paused(client: SGLangClient) -> None:
    await client.pause("in_place")
    try:
        task = asyncio.create_task(client.generate([5, 6], sampling_params={"max_new_tokens": 2, **GREEDY}))
        done, _ = await asyncio.wait({task}, timeout=0.5)
        assert not done, "generate completed while the server was paused"
    finally:
        await client.continue_()
    result = await asyncio.wait_for(task, 30)
    assert result.finish_type in ("length", "stop")


@pytest.mark.anyio
async def test_pause_retract_resumes_and_abort_mode_aborts(client: SGLangClient) -> None:
    params = {"max_new_tokens": 60, "ignore_eos": True, **GREEDY}
    reference = await client.generate([9, 10, 11], sampling_params=params)
    seen: list[GenerateResult] = []

    async def consume(rid: str) -> None:
        async for chunk in client.generate_stream([9, 10, 11], sampling_params=params, rid=rid):
            seen.append(chunk)

    task = asyncio.create_task(consume("retract-1"))
    await asyncio.wait_for(_wait_tokens(client, seen, 5), 30)
    await client.pause("retract")
    await client.continue_()
    await asyncio.wait_for(task, 30)
    assert seen[-1].output_ids == reference.output_ids  # re-prefilled, same greedy continuation

    seen.clear()
    task = asyncio.create_task(consume("pause-abort-1"))
    await asyncio.wait_for(_wait_tokens(client, seen, 2), 30)
    await client.pause("abort")
    await client.continue_()
    await asyncio.wait_for(task, 30)
    assert seen[-1].finish_type == "abort"


# ------------------------------------------------------------------------ weights


@pytest.mark.anyio
async def test_weight_update_mid_generation(client: SGLangClient, model_dirs: tuple[Path, Path]) -> None:
    base, perturbed = model_dirs
    params = {"max_new_tokens": 16, "ignore_eos": True, **GREEDY}
    before = await client.generate([12, 13, 14], sampling_params=params)
    seen: list[GenerateResult] = []

    async def consume() -> None:
        long_params = {"max_new_tokens": 300, "ignore_eos": True, **GREEDY}
        async for chunk in client.generate_stream([5, 6, 7], sampling_params=long_params, rid="span-update"):
            seen.append(chunk)

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(_wait_tokens(client, seen, 3), 30)
        results = await client.update_weights_from_disk(str(perturbed), weight_version="v2")
        assert results[0].message and results[0].num_paused_requests is not None
        await asyncio.wait_for(task, 60)
        versions = seen[-1].token_weight_versions or []
        assert versions[0] == "default" and versions[-1] == "v2"
        switch = versions.index("v2")
        assert all(v == "default" for v in versions[:switch]) and all(v == "v2" for v in versions[switch:])
        assert seen[-1].weight_version == "v2"
        assert await client.get_weight_version() == "v2"
        assert (await client.model_info())["weight_version"] == "v2"
        after = await client.generate([12, 13, 14], sampling_params=params)
        assert after.output_ids != before.output_ids
        assert after.token_weight_versions == ["v2"] * 16
    finally:
        await client.update_weights_from_disk(str(base), weight_version="default")
    restored = await client.generate([12, 13, 14], sampling_params=params)
    assert restored.output_ids == before.output_ids


@pytest.mark.anyio
async def test_weight_endpoints_report_failures(client: SGLangClient, tmp_path: Path) -> None:
    with pytest.raises(SGLangWeightUpdateError, match="no model.safetensors"):
        await client.update_weights_from_disk(str(tmp_path), weight_version="bad")
    assert await client.get_weight_version() == "default"
    with pytest.raises(SGLangWeightUpdateError, match="not supported by the local backend"):
        await client.init_weights_update_group("127.0.0.1", 29500, 1, 2)
    with pytest.raises(SGLangWeightUpdateError, match="not supported by the local backend"):
        await client.update_weights_from_distributed(["w"], ["bfloat16"], [[1]])
    [result] = await client.update_weight_version("renamed")
    assert await client.get_weight_version() == "renamed"
    await client.update_weight_version("default")
    assert result.message


# ------------------------------------------------------------------------ info / errors


@pytest.mark.anyio
async def test_info_and_health_endpoints(client: SGLangClient, server: ServerProcess) -> None:
    info = await client.model_info()
    assert info["is_generation"] is True and info["weight_version"] == "default" and info["model_path"]
    assert server.status("/get_model_info") == 200
    assert server.status("/health") == 200 and server.status("/health_generate") == 200
    assert (await client.server_info())["max_running_requests"] == 16
    await client.flush_cache()
    assert await client.health_generate()


@pytest.mark.anyio
async def test_prefix_cache_reuse_and_flush(client: SGLangClient, server: ServerProcess) -> None:
    """The same prompt twice: cached_tokens > 0 the second time; /flush_cache (refused while a request runs,
    as SGLang does) brings it back to 0."""
    prompt = "# the prefix cache keeps this prompt\n$ "
    params = {"max_new_tokens": 6, "ignore_eos": True, **GREEDY}
    first = await client.generate(text=prompt, sampling_params=params)
    second = await client.generate(text=prompt, sampling_params=params)
    assert first.meta_info["cached_tokens"] == 0
    assert second.meta_info["cached_tokens"] == len(prompt) - 1  # char tokenizer: one token a character
    assert second.output_ids == first.output_ids
    stats = (await client.server_info())["internal_states"][0]
    assert stats["prefix_cache_hits"] >= 1 and stats["prefix_cache_tokens"] > 0
    assert stats["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # tiny model: layers x (k, v) x kv heads x dim x fp32
    busy = {"text": "stay busy", "stream": True, "rid": "flush-busy",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, **GREEDY}}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/generate", json=busy) as stream:
            assert (await stream.content.readline()).startswith(b"data: ")  # generating now
            async with session.post(server.url + "/flush_cache") as refused:
                assert refused.status == 400 and "will not be performed" in await refused.text()
            await client.abort("flush-busy")
            await stream.read()
        async with session.post(server.url + "/flush_cache") as flushed:
            assert flushed.status == 200 and (await flushed.text()).startswith("Cache flushed.")
    third = await client.generate(text=prompt, sampling_params=params)
    assert third.meta_info["cached_tokens"] == 0 and third.output_ids == first.output_ids
    await client.flush_cache()  # GET/POST both answer; the client's call succeeds when idle


async def _post_raw(url: str, data: bytes | str) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(url + "/generate", data=data) as resp:
        return resp.status, await resp.json()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "shape", "needle"),
    [
        ('{"text": ', "validation", "JSON decode error"),
        ('{"text": 5}', "validation", "text"),
        ('{"text": "a", "input_ids": [1]}', "error", "Either text, input_ids"),
        ("{}", "error", "Either text, input_ids"),
        ('{"input_ids": [1, 100000]}', "error", "vocabulary"),
        ('{"text": "a", "sampling_params": {"temperature": -1}}', "error", "temperature"),
        ('{"text": "a", "sampling_params": {"top_p": 1.5}}', "error", "top_p"),
        ('{"text": "a", "sampling_params": {"top_k": 0}}', "error", "top_k"),
        ('{"text": "a", "sampling_params": {"max_new_tokens": "many"}}', "validation", "max_new_tokens"),
        ('{"text": "a", "sampling_params": {"frequency_penalty": 0.5}}', "error", "not supported"),
        ('{"text": "a", "return_logprob": true, "logprob_start_len": 0}', "error", "not supported"),
    ],
)
async def test_malformed_requests_get_sglang_error_shapes(server: ServerProcess, body: str, shape: str, needle: str) -> None:
    status, out = await _post_raw(server.url, body)
    assert status == 400
    assert isinstance(out, dict)
    if shape == "validation":
        assert out["object"] == "error" and out["type"] == "Bad Request" and out["code"] == 400 and out["param"] is None
        assert needle in out["message"]
    else:
        assert set(out) == {"error"} and needle in out["error"]["message"]


@pytest.mark.anyio
async def test_client_raises_http_error_with_message(client: SGLangClient) -> None:
    with pytest.raises(SGLangHTTPError) as info:
        await client.generate([1, 10**6])
    assert info.value.status == 400 and "vocabulary" in info.value.message


def test_a_missing_model_dir_is_refused_before_listening(tmp_path: Path) -> None:
    """A directory that cannot be served is named at once, before the server listens or torch loads."""
    missing = tmp_path / "missing"
    done = subprocess.run([sys.executable, "-m", "ops.cli", "inference", "serve", "--port", "0", "--model-dir",
                           str(missing)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""  # never listened
    assert "--model-dir" in done.stderr and str(missing) in done.stderr


@pytest.mark.parametrize(("flag", "value"), [("--prefix-cache-tokens", "-1"), ("--attention-window", "0"),
                                            ("--attention-sinks", "-2"), ("--kv-block-size", "0"),
                                            ("--kv-cache-tokens", "8"), ("--prefix-cache-disk-tokens", "4096"),
                                            ("--prefix-cache-disk-dir", "/nonexistent/kv")])
def test_bad_cache_and_window_flags_are_refused_before_listening(flag: str, value: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ops.cli", "inference", "serve", "--port", "0", flag, value],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""  # never listened
    assert flag in done.stderr and value in done.stderr


# ------------------------------------------------------------------------ api key (SGLang's --api-key)


def test_serve_refuses_to_listen_beyond_loopback_without_a_key() -> None:
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    for host in ("0.0.0.0", "::"):
        done = subprocess.run([sys.executable, "-m", "ops.cli", "inference", "serve", "--host", host, "--port", "0"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == ""  # never listened
        assert f"refusing to listen on '{host}' without an API key" in done.stderr


@pytest.mark.anyio
async def test_serve_with_a_key_from_the_environment_guards_every_endpoint_but_health(
        model_dirs: tuple[Path, Path]) -> None:
    proc = ServerProcess("--host", "0.0.0.0", "--model-dir", str(model_dirs[0]), "--max-batch", "4",
                         env_extra={API_KEY_ENV: "env-k3y"})
    try:
        assert proc.status("/health") == 200
        assert proc.status("/health_generate") == 401 and proc.status("/get_model_info") == 401
        async with SGLangClient([proc.url], api_key="env-k3y") as client:
            await client.wait_healthy(timeout=STARTUP_TIMEOUT_S)
            result = await client.generate([5, 6, 7], sampling_params={"max_new_tokens": 4, **GREEDY})
            assert len(result.output_ids) == 4 and result.weight_version == "default"
            [update] = await client.update_weights_from_disk(str(model_dirs[1]), weight_version="v2")
            assert await client.get_weight_version() == "v2" and update.message
        async with SGLangClient([proc.url], retries=0) as client:
            with pytest.raises(SGLangWeightUpdateError, match="Unauthorized"):
                await client.update_weights_from_disk(str(model_dirs[0]), weight_version="evil")
            with pytest.raises(SGLangHTTPError) as info:
                await client.generate([5])
            assert info.value.status == 401
        assert proc.proc.poll() is None
        proc.proc.terminate()
        proc.proc.wait(timeout=30)
        assert "env-k3y" not in proc.stderr_tail()  # never logged
    finally:
        proc.stop()


@pytest.mark.anyio
async def test_embedded_server_gets_the_configured_key(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """What `rollout run` starts (modelserver/launch.py): the key reaches the child, not its argv."""
    from modelserver.launch import LocalServer

    server = LocalServer(model_dirs[0], log_path=tmp_path / "server.log", max_batch=4, api_key="run-k3y")
    async with server as url:
        assert server.proc is not None
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
            assert b"run-k3y" not in f.read()
        async with SGLangClient([url], api_key="run-k3y") as client:
            assert len((await client.generate([5, 6], sampling_params={"max_new_tokens": 2, **GREEDY})).output_ids) == 2
        async with SGLangClient([url], retries=0) as client:
            with pytest.raises(SGLangHTTPError) as info:
                await client.model_info()
            assert info.value.status == 401
    assert "run-k3y" not in (tmp_path / "server.log").read_text()
