"""aiohttp server speaking SGLang's native HTTP API over a :class:`LocalEngine`.

The model loads in the background after the socket is bound: ``/health`` answers 200 at once,
``/health_generate`` and ``/generate`` answer 503 until the model is ready.

Extension to SGLang's response: ``meta_info["output_token_weight_versions"]`` lists, for every output
token, the weight version it was sampled under (a generation may span a weight update).

Authentication, as SGLang's ``--api-key``: with ``ServerConfig.api_key`` every endpoint but ``/health``
needs ``Authorization: Bearer <key>`` and answers 401 ``{"error": "Unauthorized"}`` without it (SGLang
also leaves ``/health_generate`` and ``/metrics`` open; here ``/health_generate`` runs a generation, so
it is guarded). :func:`serve` refuses to listen beyond loopback without a key: the weight-update
endpoints would load any path anyone who reaches the port names.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import tempfile
import time
import socket
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from aiohttp import web

from modelserver.local.engine import LocalEngine, Rescorer, Sequence, WeightUpdateError
from modelserver.local.model_thread import ModelThread
from modelserver.local.openai_api import add_openai_routes
from modelserver.local.protocol import (
    BadRequest,
    GenerateRequest,
    ProtocolError,
    SamplingParams,
    ValidationFailed,
    parse_generate_request,
)

__all__ = ["InsecureBindError", "ServerConfig", "build_app", "is_loopback", "serve"]

log = logging.getLogger(__name__)

_NOT_SUPPORTED = "not supported by the local backend (no NCCL on CPU); use /update_weights_from_disk"
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class ServerConfig:
    """What ``rollout inference serve`` configures."""

    host: str = "127.0.0.1"
    port: int = 30000
    model_dir: str | None = None
    max_batch: int = 32
    chunk_size: int = 512
    dtype: str = "fp32"
    prefix_cache_tokens: int = 8192
    """Tokens of finished sequences' KV kept for reuse (the retained prefix cache); 0 disables it."""
    kv_cache: str = "paged"
    """The KV store: ``paged`` (blocks, block tables, prefix tree) or ``slot`` (a row per sequence)."""
    kv_cache_tokens: int = 65536
    """Paged store: the pool's bound in tokens (x the KV bytes per token); requests queue when it is full."""
    kv_block_size: int = 16
    """Paged store: tokens per block."""
    prefix_cache_int8_tokens: int = 0
    """Tokens of the prefix cache's int8 tier (entries evicted from the hot tier, quantised); 0: none."""
    prefix_cache_disk_tokens: int = 0
    """Tokens of the disk tier below the int8 tier (entries it evicts, a file each); 0: none."""
    prefix_cache_disk_dir: str | None = None
    """Where the disk tier makes its private directory (None: the system's temporary directory)."""
    attention_window: int | None = None
    """Sliding-window attention: each token attends to the last ``attention_window`` positions (and the
    sinks); None: full attention."""
    attention_sinks: int = 0
    """With a window: the first positions every token keeps attending to (attention sinks)."""
    seed: int = 0
    weight_version: str = "default"
    gc_freeze: bool = False
    """Once the model is loaded, freeze the heap out of the cyclic collector's reach (``engine.process``);
    ``rollout inference serve`` sets it: the server is then its own process."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer key every endpoint but ``/health`` requires (None: none, and loopback only)."""
    rescore: Rescorer | None = field(default=None, repr=False)
    """Re-scores each finished sample (``LocalEngine.rescore``; ``rollout inference serve --rescore`` hands in
    the learner's ``learning.core.score_tokens``); None: the decode-time logprobs are reported."""


class InsecureBindError(ValueError):
    """Asked to listen beyond loopback without an api key."""

    def __init__(self, host: str) -> None:
        super().__init__(
            f"refusing to listen on {host!r} without an API key: beyond loopback anyone who reaches the port "
            "could generate and replace the weights (/update_weights_from_disk). Give a key (--api-key-file "
            "FILE, --api-key KEY or ROLLOUT__INFERENCE__API_KEY) or bind 127.0.0.1")
        self.host = host


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (``""`` means every interface: no)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def _auth_middleware(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/health":
            return await handler(request)
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):  # constant time: the comparison leaks no prefix
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return require_key


class ModelLoadError(RuntimeError):
    """The served model could not be loaded: :func:`serve` stops with it (no server waits forever on a 503)."""


class ServerState:
    """The app's engine slot; ``engine`` is ``None`` until the model is loaded (or the engine built)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: LocalEngine | None = None
        self.load_error: str | None = None
        self.load_failed = asyncio.Event()
        self.model_dir: str = config.model_dir or ""
        self.tmp: tempfile.TemporaryDirectory[str] | None = None


_STATE = web.AppKey("state", ServerState)


def _state(request: web.Request) -> ServerState:
    return request.app[_STATE]


def _json_error(exc: ProtocolError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _not_ready(state: ServerState) -> web.Response:
    message = state.load_error or "The server is not ready: the model is still loading."
    return web.json_response({"error": {"message": message}}, status=503)


async def _read_json(request: web.Request, *, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise ValidationFailed("Request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValidationFailed(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise ValidationFailed("Input should be a valid dictionary or object to extract fields from")
    return body


async def _loaded(request: web.Request) -> tuple[ServerState, LocalEngine, dict[str, Any]] | web.Response:
    """A request that needs the model: its state, engine and JSON body, or the answer to give instead (a body
    that is not a JSON object: 400; the model still loading or failed: 503)."""
    state = _state(request)
    try:
        body = await _read_json(request)
    except ProtocolError as exc:
        return _json_error(exc)
    if state.engine is None:
        return _not_ready(state)
    return state, state.engine, body


# ------------------------------------------------------------------------ generate


def _result_json(engine: LocalEngine, seq: Sequence, req: GenerateRequest, index: int | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": seq.cached_tokens,
        "weight_version": seq.weight_version,
        "output_token_weight_versions": list(seq.token_versions),
        "e2e_latency": (seq.finished_at or time.monotonic()) - seq.created,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
        if req.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [[[lp, tok, None] for lp, tok in top] for top in seq.top_logprobs]
    out: dict[str, Any] = {"text": engine.output_text(seq), "output_ids": list(seq.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def _submit_all(engine: LocalEngine, req: GenerateRequest) -> list[Sequence]:
    prompts: list[list[int]]
    if req.texts is not None:
        prompts = [engine.tokenizer.encode(t) for t in req.texts]
        if any(not p for p in prompts):
            raise BadRequest("text: a prompt encodes to zero tokens")
    else:
        prompts = req.input_ids or []
    seqs: list[Sequence] = []
    try:
        for prompt, rid in zip(prompts, req.rids):
            for j in range(req.sampling.n):
                params = req.sampling
                if params.n > 1 and params.sampling_seed is not None:
                    # n samples of one prompt must differ: seed + j for the j-th.
                    params = replace(params, sampling_seed=params.sampling_seed + j)
                sample_rid = rid if (rid is None or req.sampling.n == 1) else f"{rid}-{j}"
                seqs.append(engine.submit(prompt, params, rid=sample_rid, top_logprobs_num=req.top_logprobs_num))
    except BadRequest:
        for seq in seqs:
            engine.abort(seq.rid)
        raise
    return seqs


async def handle_generate(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    try:
        body = await _read_json(request)
        engine = state.engine
        if engine is None:
            return _not_ready(state)
        req = parse_generate_request(body, vocab_size=engine.vocab_size)
        seqs = _submit_all(engine, req)
    except ProtocolError as exc:
        return _json_error(exc)
    listed = req.is_batch or req.sampling.n > 1
    if req.stream:
        return await _stream(request, engine, req, seqs, listed)
    await engine.wait_finished(seqs)
    results = [_result_json(engine, seq, req, None) for seq in seqs]
    return web.json_response(results if listed else results[0])


async def _stream(
    request: web.Request, engine: LocalEngine, req: GenerateRequest, seqs: list[Sequence], listed: bool
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    updates: asyncio.Queue[int] = asyncio.Queue()

    async def watch(i: int, seq: Sequence) -> None:
        while True:
            await seq.wait_changed()
            updates.put_nowait(i)
            if seq.finished:
                return

    watchers = [asyncio.create_task(watch(i, seq)) for i, seq in enumerate(seqs)]
    remaining = len(seqs)
    try:
        while remaining:
            i = await updates.get()
            # coalesce: one cumulative chunk per sequence per wake-up
            ready = {i}
            while not updates.empty():
                ready.add(updates.get_nowait())
            for k in sorted(ready):
                chunk = _result_json(engine, seqs[k], req, k if listed else None)
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if seqs[k].finished:
                    remaining -= 1
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client went away: nothing to report to (the finally below aborts its requests)
    except Exception as exc:  # report mid-stream failures in SGLang's shape before the terminator
        log.exception("stream failed")
        error = {"error": {"message": f"internal error: {exc!r}"}}
        await response.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
    finally:
        for task in watchers:
            task.cancel()
        engine.abort_unfinished(seqs)
    await response.write_eof()
    return response


# ------------------------------------------------------------------------ control


async def handle_abort(request: web.Request) -> web.Response:
    state = _state(request)
    try:
        body = await _read_json(request, allow_empty=True)
    except ProtocolError as exc:
        return _json_error(exc)
    if state.engine is not None:
        if body.get("abort_all"):
            state.engine.abort_all()
        elif isinstance(body.get("rid"), str) and body["rid"]:
            state.engine.abort(body["rid"])
    return web.Response(status=200)


async def handle_pause(request: web.Request) -> web.Response:
    state = _state(request)
    try:
        body = await _read_json(request, allow_empty=True)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}")
    except ProtocolError as exc:
        return _json_error(exc)
    if state.engine is None:
        return _not_ready(state)
    await state.engine.pause(mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def handle_continue(request: web.Request) -> web.Response:
    state = _state(request)
    if state.engine is None:
        return _not_ready(state)
    state.engine.continue_()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def handle_update_weights_from_disk(request: web.Request) -> web.Response:
    loaded = await _loaded(request)
    if isinstance(loaded, web.Response):
        return loaded
    state, engine, body = loaded
    path = body.get("model_path")
    version = body.get("weight_version")
    if not isinstance(path, str) or not path:
        return web.json_response({"success": False, "message": "model_path is required"}, status=400)
    if version is not None and not isinstance(version, str):
        return web.json_response({"success": False, "message": "weight_version must be a string"}, status=400)
    load_format = body.get("load_format")
    if load_format not in (None, "auto", "safetensors"):
        return web.json_response({"success": False, "message": f"load_format {load_format!r} is not supported"}, status=400)
    try:
        paused = await engine.update_weights_from_disk(
            path, weight_version=version, abort_all=bool(body.get("abort_all_requests", False))
        )
    except (WeightUpdateError, OSError, ValueError, RuntimeError) as exc:
        return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"}, status=400)
    state.model_dir = path
    return web.json_response(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": paused}
    )


async def handle_update_weight_version(request: web.Request) -> web.Response:
    loaded = await _loaded(request)
    if isinstance(loaded, web.Response):
        return loaded
    _, engine, body = loaded
    version = body.get("new_version")
    if not isinstance(version, str) or not version:
        return web.json_response({"success": False, "message": "new_version must be a non-empty string"}, status=400)
    if body.get("abort_all_requests"):
        engine.abort_all("Aborted by /update_weight_version.")
    engine.set_weight_version(version)
    return web.json_response(
        {"success": True, "message": f"Weight version updated to {version}.", "new_version": version}
    )


async def handle_get_weights_by_name(request: web.Request) -> web.Response:
    """SGLang's ``/get_weights_by_name`` (GET or POST, JSON body ``{"name", "truncate_size": 100}``): the
    parameter's leading entries along its first dimension, in the served dtype, as a bare nested JSON list.
    A bad request is a 400 ``{"error": {"message"}}`` naming the parameter (SGLang's shape; its message
    there is only "Get parameter by name failed")."""
    loaded = await _loaded(request)
    if isinstance(loaded, web.Response):
        return loaded
    _, engine, body = loaded
    if not isinstance(engine, LocalEngine):  # the sim backend shares this app and holds no weights
        return web.json_response({"error": {"message": "/get_weights_by_name: a SIMULATED server holds no weights"}},
                                 status=404)
    name = body.get("name")
    size = body.get("truncate_size", 100)
    if not isinstance(name, str) or not name:
        return web.json_response({"error": {"message": "name (a parameter name) is required"}}, status=400)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return web.json_response({"error": {"message": f"{name}: truncate_size must be an integer >= 0, "
                                                       f"got {size!r}"}}, status=400)
    try:
        values = await engine.get_weights_by_name(name, size)
    except KeyError:
        return web.json_response({"error": {"message": f"no parameter named {name!r} in the served model"}},
                                 status=400)
    return web.json_response(values)


async def handle_not_supported(request: web.Request) -> web.Response:
    return web.json_response({"success": False, "message": f"{request.path} is {_NOT_SUPPORTED}"}, status=400)


# ------------------------------------------------------------------------ info / health


async def handle_get_weight_version(request: web.Request) -> web.Response:
    state = _state(request)
    if state.engine is None:
        return _not_ready(state)
    return web.json_response({"weight_version": state.engine.weight_version})


async def handle_model_info(request: web.Request) -> web.Response:
    state = _state(request)
    if state.engine is None:
        return _not_ready(state)
    config = state.engine.model.config
    return web.json_response(
        {
            "model_path": state.model_dir,
            "tokenizer_path": state.model_dir,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "vocab_size": state.engine.vocab_size,
            "max_context_length": state.engine.context_length,
        }
    )


async def handle_server_info(request: web.Request) -> web.Response:
    state = _state(request)
    info: dict[str, Any] = {
        "backend": "rollout-engine-local",
        "model_path": state.model_dir,
        "host": state.config.host,
        "port": state.config.port,
        "max_running_requests": state.config.max_batch,
        "chunked_prefill_size": state.config.chunk_size,
        "ready": state.engine is not None,
    }
    if state.engine is not None:
        stats = state.engine.statistics()
        info.update(
            weight_version=stats.weight_version,
            context_length=state.engine.context_length,
            internal_states=[stats.__dict__],
        )
    return web.json_response(info)


_FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. "
               "(When there are running or waiting requests, the operation will not be performed.)\n")


async def handle_flush_cache(request: web.Request) -> web.Response:
    # SGLang's answer, word for word: 200 when the cache was freed, 400 (same text) when requests are
    # running or waiting, in which case nothing is freed.
    state = _state(request)
    engine = state.engine
    if engine is None:
        return web.Response(text=_FLUSH_TEXT)  # nothing is cached before the model is loaded
    if engine.flush_cache():
        log.info("prefix cache flushed")
        return web.Response(text=_FLUSH_TEXT)
    log.warning("flush_cache refused: %d requests running, %d waiting", *_load(engine))
    return web.Response(text=_FLUSH_TEXT, status=400)


def _load(engine: LocalEngine) -> tuple[int, int]:
    stats = engine.statistics()
    return stats.running, stats.waiting


async def handle_health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def handle_health_generate(request: web.Request) -> web.Response:
    state = _state(request)
    engine = state.engine
    if engine is None:
        return web.Response(status=503, text=state.load_error or "model is loading")
    if engine.paused:
        return web.Response(status=200)
    bos = engine.tokenizer.bos_token_id
    seq = engine.submit([bos if bos is not None else 0], SamplingParams(max_new_tokens=1, temperature=0.0), rid=f"HEALTH_CHECK_{time.monotonic_ns()}")
    try:
        with anyio.fail_after(HEALTH_GENERATE_TIMEOUT_S):
            while not seq.finished:
                await seq.wait_changed()
    except TimeoutError:
        engine.abort(seq.rid)
        return web.Response(status=503, text="health generation timed out")
    return web.Response(status=200)


# ------------------------------------------------------------------------ app


async def _load_engine(state: ServerState) -> None:
    from transformers.utils import logging as hf_logging

    from modelserver.llm import load_model_dir, write_tiny_model_dir

    hf_logging.disable_progress_bar()
    config = state.config
    # Every torch operation of the served model, its loading included, runs on this one thread: a second
    # thread's OpenMP team would throttle the first's (local/model_thread.py).
    model_thread = ModelThread()
    try:
        if config.model_dir is None:
            state.tmp = tempfile.TemporaryDirectory(prefix="rollout-local-model-")
            path = await model_thread.run(lambda: write_tiny_model_dir(state.tmp.name, seed=config.seed))  # type: ignore[union-attr]
            state.model_dir = str(path)
        model, tokenizer = await model_thread.run(lambda: load_model_dir(state.model_dir))
    except Exception as exc:
        model_thread.close()
        log.exception("model load failed")
        state.load_error = f"model load failed: {exc!r}"
        state.load_failed.set()
        return
    engine = LocalEngine(
        model,
        tokenizer,
        max_batch=config.max_batch,
        chunk_size=config.chunk_size,
        dtype=config.dtype,
        prefix_cache_tokens=config.prefix_cache_tokens,
        prefix_cache_int8_tokens=config.prefix_cache_int8_tokens,
        prefix_cache_disk_tokens=config.prefix_cache_disk_tokens,
        prefix_cache_disk_dir=config.prefix_cache_disk_dir,
        kv_cache=config.kv_cache,
        kv_cache_tokens=config.kv_cache_tokens,
        kv_block_size=config.kv_block_size,
        attention_window=config.attention_window,
        attention_sinks=config.attention_sinks,
        weight_version=config.weight_version,
        model_path=state.model_dir,
        rescore=config.rescore,
        model_thread=model_thread,
        owns_model_thread=True,
    )
    await engine.start()
    state.engine = engine
    log.info("model loaded from %s", state.model_dir)
    if config.gc_freeze:
        from engine.process import freeze_startup_heap

        freeze_startup_heap()


EngineStarter = Callable[[ServerState], Coroutine[Any, Any, None]]
"""Builds and starts the served engine and puts it in ``state.engine``; on failure it sets
``state.load_error`` and ``state.load_failed`` (the sim backend brings its own: no model to load)."""


def build_app(config: ServerConfig, start_engine: EngineStarter = _load_engine) -> web.Application:
    """The aiohttp application; the model starts loading (``start_engine`` runs) when the app starts."""
    middlewares = [_auth_middleware(config.api_key)] if config.api_key else []
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=middlewares)
    state = ServerState(config)
    app[_STATE] = state

    async def lifecycle(app: web.Application) -> Any:
        loader = asyncio.create_task(start_engine(state))
        yield
        loader.cancel()
        try:
            await loader
        except asyncio.CancelledError:
            pass
        if state.engine is not None:
            await state.engine.aclose()
        if state.tmp is not None:
            state.tmp.cleanup()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_post("/generate", handle_generate)
    r.add_post("/abort_request", handle_abort)
    r.add_post("/pause_generation", handle_pause)
    r.add_post("/continue_generation", handle_continue)
    r.add_post("/update_weights_from_disk", handle_update_weights_from_disk)
    r.add_post("/update_weight_version", handle_update_weight_version)
    for path in (
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
    ):
        r.add_post(path, handle_not_supported)
    r.add_get("/get_weight_version", handle_get_weight_version)
    r.add_get("/get_weights_by_name", handle_get_weights_by_name)
    r.add_post("/get_weights_by_name", handle_get_weights_by_name)
    r.add_get("/model_info", handle_model_info)
    r.add_get("/get_model_info", handle_model_info)
    r.add_get("/server_info", handle_server_info)
    r.add_get("/get_server_info", handle_server_info)
    r.add_route("*", "/flush_cache", handle_flush_cache)
    r.add_get("/health", handle_health)
    r.add_get("/health_generate", handle_health_generate)
    add_openai_routes(app, lambda request: _state(request).engine)
    return app


async def serve(config: ServerConfig, *, on_bound: Callable[[str, int], None] | None = None,
                start_engine: EngineStarter = _load_engine) -> None:
    """Run the server until cancelled; ``on_bound(host, port)`` is called once the socket listens.

    Raises :class:`InsecureBindError` (before binding) for a non-loopback host without an api key, and
    :class:`ModelLoadError` as soon as the model fails to load, so the process that runs the server exits
    and whoever waits for it to become healthy learns at once.
    """
    if not config.api_key and not is_loopback(config.host):
        raise InsecureBindError(config.host)
    sock = socket.create_server((config.host, config.port))
    config = replace(config, port=int(sock.getsockname()[1]))
    app = build_app(config, start_engine)
    state = app[_STATE]
    runner = web.AppRunner(app, access_log=None)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        if on_bound is not None:
            on_bound(config.host, config.port)
        await state.load_failed.wait()
        raise ModelLoadError(f"{state.load_error} (model directory {state.model_dir or '(a tiny model)'})")
    finally:
        await runner.cleanup()
        sock.close()
