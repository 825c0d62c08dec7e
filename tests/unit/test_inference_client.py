"""SGLangClient against in-process fake servers: SSE parsing, routing, retries, error classification."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from modelserver.client import (
    ROUTING_HEADER,
    SGLangClient,
    SGLangConnectionError,
    SGLangHTTPError,
    SGLangProtocolError,
    SGLangWeightUpdateError,
    SSEParser,
    is_retryable_status,
    pick_server,
)

Handler = Callable[[web.Request], Any]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _result(ids: list[int], finish: dict[str, Any] | None) -> dict[str, Any]:
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 2, "completion_tokens": len(ids), "weight_version": "7",
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    return {"text": "x" * len(ids), "output_ids": ids, "meta_info": meta}


async def _serve(routes: dict[str, Handler]) -> TestServer:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    server = TestServer(app, port=0)
    await server.start_server()
    return server


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[dict[str, Handler]], Any]]:
    servers: list[TestServer] = []

    async def make(routes: dict[str, Handler]) -> str:
        server = await _serve(routes)
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield make
    for server in servers:
        await server.close()


# ------------------------------------------------------------------------ pure functions


def test_sse_parser_handles_split_chunks_crlf_comments_and_multiline() -> None:
    parser = SSEParser()
    stream = b': keep-alive\n\ndata: {"a": 1}\r\n\r\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
    events: list[str] = []
    for i in range(0, len(stream), 3):  # byte-by-byte-ish delivery
        events += parser.feed(stream[i : i + 3])
    assert events == ['{"a": 1}', "line1\nline2", "[DONE]"]
    parser.feed(b"data: tail")
    assert parser.close() == ["tail"]


def test_routing_is_stable_and_spreads_keys() -> None:
    urls = ["http://a", "http://b", "http://c"]
    picks = {k: pick_server(urls, k) for k in (f"episode-{i}" for i in range(300))}
    assert all(pick_server(urls, k) == u for k, u in picks.items())
    counts = {u: list(picks.values()).count(u) for u in urls}
    assert min(counts.values()) > 60
    assert pick_server(urls, "episode-1") == pick_server(list(urls), "episode-1")


def test_retryable_statuses() -> None:
    assert [s for s in (200, 400, 404, 408, 429, 500, 502, 503) if is_retryable_status(s)] == [408, 429, 500, 502, 503]


# ------------------------------------------------------------------------ against fake servers


@pytest.mark.anyio
async def test_generate_routes_by_key_and_sends_the_routing_header(fake) -> None:  # type: ignore[no-untyped-def]
    seen: dict[str, list[str | None]] = {"a": [], "b": []}

    def handler(name: str) -> Handler:
        async def generate(request: web.Request) -> web.Response:
            seen[name].append(request.headers.get(ROUTING_HEADER))
            return web.json_response(_result([1, 2], {"type": "length", "length": 2}))

        return generate

    urls = [await fake({"/generate": handler("a")}), await fake({"/generate": handler("b")})]
    async with SGLangClient(urls) as client:
        for _ in range(3):
            result = await client.generate([1, 2], key="episode-42")
        assert result.output_ids == [1, 2] and result.logprobs == [-0.5, -0.5] and result.weight_version == "7"
        target = "a" if pick_server(urls, "episode-42") == urls[0] else "b"
        assert seen[target] == ["episode-42"] * 3
        await client.generate([1])  # no key: round-robin, no header
    assert None in seen["a"] + seen["b"]


@pytest.mark.anyio
async def test_stream_parses_cumulative_chunks_and_mid_stream_errors(fake) -> None:  # type: ignore[no-untyped-def]
    async def good(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ids, finish in (([5], None), ([5, 6], None), ([5, 6, 7], {"type": "stop", "matched": 7})):
            await resp.write(b"data: " + json.dumps(_result(ids, finish)).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(_result([5], None)).encode() + b"\n\n")
        await resp.write(b'data: {"error": {"message": "CUDA out of memory"}}\n\ndata: [DONE]\n\n')
        return resp

    async def truncated(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(_result([5], None)).encode() + b"\n\n")
        return resp

    async with SGLangClient([await fake({"/generate": good})]) as client:
        chunks = [c async for c in client.generate_stream([1, 2])]
    assert [c.output_ids for c in chunks] == [[5], [5, 6], [5, 6, 7]]
    assert chunks[-1].finish_reason == {"type": "stop", "matched": 7} and not chunks[0].finished
    for handler, error in ((broken, SGLangHTTPError), (truncated, SGLangProtocolError)):
        async with SGLangClient([await fake({"/generate": handler})]) as client:
            with pytest.raises(error):
                _ = [c async for c in client.generate_stream([1])]


@pytest.mark.anyio
async def test_error_classification(fake) -> None:  # type: ignore[no-untyped-def]
    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>502 Bad Gateway</body></html>", status=502, content_type="text/html")

    async def wrong_shape(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    async def validation(request: web.Request) -> web.Response:
        return web.json_response({"object": "error", "message": "bad field", "type": "Bad Request", "param": None, "code": 400}, status=400)

    async def weight_fail(request: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": "shape mismatch"}, status=400)

    cases = [(html, SGLangProtocolError), (wrong_shape, SGLangProtocolError), (validation, SGLangHTTPError)]
    for handler, error in cases:
        url = await fake({"/generate": handler})
        async with SGLangClient([url], retries=0) as client:
            with pytest.raises(error) as info:
                await client.generate([1])
            assert info.value.url == url
    url = await fake({"/update_weights_from_disk": weight_fail})
    async with SGLangClient([url], retries=0) as client:
        with pytest.raises(SGLangWeightUpdateError, match="shape mismatch"):
            await client.update_weights_from_disk("/w", "v1")


@pytest.mark.anyio
async def test_retries_then_succeeds_and_model_info_falls_back(fake) -> None:  # type: ignore[no-untyped-def]
    calls = {"n": 0}

    async def flaky(request: web.Request) -> web.Response:
        calls["n"] += 1
        if calls["n"] < 3:
            return web.Response(status=503, text="loading")
        return web.json_response({"weight_version": "v9"})

    async def old_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/m", "is_generation": True})

    url = await fake({"/get_weight_version": flaky, "/get_model_info": old_info})
    async with SGLangClient([url], retries=3, backoff_s=0.001) as client:
        assert await client.get_weight_version() == "v9" and calls["n"] == 3
        assert (await client.model_info())["model_path"] == "/m"


@pytest.mark.anyio
async def test_generate_is_not_retried_after_a_server_error(fake) -> None:  # type: ignore[no-untyped-def]
    calls = {"n": 0}

    async def failing(request: web.Request) -> web.Response:
        calls["n"] += 1
        return web.json_response({"error": {"message": "boom"}}, status=500)

    url = await fake({"/generate": failing})
    async with SGLangClient([url], retries=3, backoff_s=0.001) as client:
        with pytest.raises(SGLangHTTPError, match="boom"):
            await client.generate([1])
    assert calls["n"] == 1


@pytest.mark.anyio
async def test_unreachable_server_raises_connection_error() -> None:
    async with SGLangClient(["http://127.0.0.1:9"], retries=1, backoff_s=0.001, connect_timeout=2) as client:
        with pytest.raises(SGLangConnectionError) as info:
            await client.get_weight_version()
        assert info.value.attempts == 2
        assert not await client.health_generate()


@pytest.mark.anyio
@pytest.mark.parametrize("not_found", ["aiohttp", "fastapi"])
async def test_weight_version_falls_back_to_model_info_when_the_endpoint_is_missing(fake, not_found: str) -> None:  # type: ignore[no-untyped-def]
    """Upstream SGLang v0.5.15 answers /get_weight_version 404; the version is in /get_model_info too."""
    calls: dict[str, int] = {"/get_weight_version": 0, "/get_model_info": 0}

    async def missing(request: web.Request) -> web.Response:
        calls[request.path] += 1
        if not_found == "fastapi":  # SGLang's own 404 body
            return web.json_response({"detail": "Not Found"}, status=404)
        raise web.HTTPNotFound()  # aiohttp's plain-text 404

    async def info(request: web.Request) -> web.Response:
        calls[request.path] += 1
        return web.json_response({"model_path": "/models/m", "tokenizer_path": "/models/m", "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": "12"})

    url = await fake({"/get_weight_version": missing, "/get_model_info": info})  # no /model_info either: 404
    async with SGLangClient([url], retries=2, backoff_s=0.001) as client:
        assert await client.get_weight_version() == "12"
        assert await client.get_weight_version() == "12"
    # a 404 is not retried, and the missing endpoint is asked once, not on every call
    assert calls == {"/get_weight_version": 1, "/get_model_info": 2}


@pytest.mark.anyio
async def test_weight_version_missing_everywhere_is_a_protocol_error(fake) -> None:  # type: ignore[no-untyped-def]
    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/m", "is_generation": True})

    url = await fake({"/model_info": info})
    async with SGLangClient([url], retries=0) as client:
        with pytest.raises(SGLangProtocolError, match="weight_version"):
            await client.get_weight_version()


@pytest.mark.anyio
async def test_weight_version_endpoint_errors_other_than_404_propagate(fake) -> None:  # type: ignore[no-untyped-def]
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "scheduler died"}}, status=500)

    url = await fake({"/get_weight_version": broken})
    async with SGLangClient([url], retries=0) as client:
        with pytest.raises(SGLangHTTPError, match="scheduler died"):
            await client.get_weight_version()


@pytest.mark.anyio
async def test_get_weights_by_name_sends_sglangs_body_and_classifies_its_answers(fake) -> None:  # type: ignore[no-untyped-def]
    """SGLang: {"name", "truncate_size"} in, a bare nested list out; 400 {"error"} for a name it cannot answer."""
    seen: list[Any] = []

    async def weights(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.method, body))
        if body["name"] == "bad":
            return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)
        if body["name"] == "dict":
            return web.json_response({"parameter": [1.0]})
        return web.json_response([[0.5, -0.25]] * body["truncate_size"])

    async def missing(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)  # FastAPI's, for a path it does not have

    url = await fake({"/get_weights_by_name": weights})
    async with SGLangClient([url], retries=2, backoff_s=0.001) as client:
        assert await client.get_weights_by_name("model.norm.weight", 2) == [[0.5, -0.25], [0.5, -0.25]]
        with pytest.raises(SGLangHTTPError) as http_error:
            await client.get_weights_by_name("bad")
        assert http_error.value.status == 400 and http_error.value.message == "Get parameter by name failed"
        with pytest.raises(SGLangProtocolError):
            await client.get_weights_by_name("dict")
    assert seen[:2] == [("POST", {"name": "model.norm.weight", "truncate_size": 2}),
                        ("POST", {"name": "bad", "truncate_size": 100})]  # the 400 is not retried
    async with SGLangClient([await fake({"/get_weights_by_name": missing})], retries=2, backoff_s=0.001) as client:
        with pytest.raises(SGLangProtocolError) as not_found:
            await client.get_weights_by_name("model.norm.weight")
        assert not_found.value.status == 404


# ------------------------------------------------------------------------ api key (SGLang's --api-key)


@pytest.mark.anyio
async def test_client_sends_the_bearer_key_on_every_call(fake) -> None:  # type: ignore[no-untyped-def]
    seen: list[tuple[str, str | None]] = []

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.path == "/generate" and (await request.json()).get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps(_result([5], {"type": "length", "length": 1})).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if request.path == "/generate":
            return web.json_response(_result([5], {"type": "length", "length": 1}))
        if request.path == "/update_weights_from_disk":
            return web.json_response({"success": True, "message": "ok"})
        if request.path == "/health_generate":
            return web.Response()
        return web.json_response({"weight_version": "1"})

    url = await fake({"/generate": record, "/get_weight_version": record, "/update_weights_from_disk": record,
                      "/health_generate": record})
    async with SGLangClient([url], api_key="s3cret") as client:
        await client.generate([1], key="episode-1")
        _ = [c async for c in client.generate_stream([1])]
        await client.get_weight_version()
        await client.update_weights_from_disk("/w", "2")
        assert await client.health_generate()
    assert [path for path, _ in seen] == ["/generate", "/generate", "/get_weight_version", "/update_weights_from_disk",
                                          "/health_generate"]
    assert {auth for _, auth in seen} == {"Bearer s3cret"}
    seen.clear()
    async with SGLangClient([url]) as client:  # no key: no header
        await client.generate([1])
    assert seen == [("/generate", None)]


@pytest.fixture
async def local_app_with_key() -> AsyncIterator[str]:
    """The local server's app in-process (tiny model, built in a temp dir), requiring the key 'k3y'."""
    from modelserver.local.server import ServerConfig, build_app

    server = TestServer(build_app(ServerConfig(api_key="k3y", max_batch=4, chunk_size=64)), port=0)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.mark.anyio
async def test_local_server_requires_the_key_everywhere_but_health(local_app_with_key: str) -> None:
    import aiohttp

    url = local_app_with_key
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as resp:
            assert resp.status == 200
        for method, path in (("GET", "/server_info"), ("POST", "/generate"), ("POST", "/update_weights_from_disk"),
                             ("POST", "/abort_request"), ("GET", "/get_weight_version"), ("GET", "/health_generate"),
                             ("GET", "/no_such_endpoint")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
                async with http.request(method, url + path, json={"model_path": "/etc"}, headers=headers) as resp:
                    assert resp.status == 401, (path, headers)
                    assert await resp.json() == {"error": "Unauthorized"}
        async with http.get(url + "/server_info", headers={"Authorization": "Bearer k3y"}) as resp:
            assert resp.status == 200 and (await resp.json())["backend"] == "rollout-engine-local"
    async with SGLangClient([url], retries=0) as client:
        with pytest.raises(SGLangHTTPError) as info:
            await client.server_info()
        assert info.value.status == 401 and info.value.message == "Unauthorized" and "k3y" not in str(info.value)
    async with SGLangClient([url], api_key="k3y") as client:
        await client.wait_healthy(timeout=120)
        result = await client.generate([5, 6], sampling_params={"max_new_tokens": 3, "temperature": 0.0})
        assert len(result.output_ids) == 3
        assert await client.get_weight_version() == "default"


def test_loopback_detection() -> None:
    from modelserver.local.server import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.1.2.3", "192.168.0.1"))


@pytest.mark.anyio
@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
async def test_local_server_refuses_to_listen_beyond_loopback_without_a_key(host: str) -> None:
    from modelserver.local.server import InsecureBindError, ServerConfig, serve

    bound: list[int] = []
    with pytest.raises(InsecureBindError, match="without an API key"):
        await serve(ServerConfig(host=host, port=0), on_bound=lambda h, p: bound.append(p))
    assert bound == []


@pytest.mark.anyio
async def test_local_server_listens_on_all_interfaces_with_a_key() -> None:
    import asyncio

    from modelserver.local.server import ServerConfig, serve

    bound = asyncio.Event()
    config = ServerConfig(host="0.0.0.0", port=0, api_key="k3y", max_batch=2, chunk_size=16)
    assert "k3y" not in repr(config)
    # cancelled once, as `rollout inference serve` cancels it on SIGTERM, so its clean-up runs
    task = asyncio.create_task(serve(config, on_bound=lambda h, p: bound.set()))
    await asyncio.wait_for(bound.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
