"""Async client of SGLang's native HTTP API (one or several servers, or a router).

Routing: a call with a ``key`` (episode or sample id) goes to ``urls[stable_hash(key) % len(urls)]`` and
carries the ``X-SMG-Routing-Key`` header, so a router keeps the session on one worker; calls without a
key go round-robin. Control calls (abort, pause, continue, weight updates, flush) go to every server.

Retries, bounded, with exponential backoff and jitter:

- idempotent calls (GET endpoints, abort, pause, continue, weight updates, health) retry on connection
  errors, timeouts, HTTP 5xx, 408 and 429;
- ``generate`` retries only when the server certainly did no work: the connection could not be made,
  or the answer was 429 (queue full) or 503 (not ready). A streaming generation never retries after its
  first chunk.

Authentication: with ``api_key`` (SGLang's ``--api-key``) every request carries
``Authorization: Bearer <key>``; the key is never logged nor put in an error message.

Errors carry data: :class:`SGLangHTTPError` (the server answered an error object),
:class:`SGLangProtocolError` (the answer is not SGLang's protocol: HTML, wrong JSON shape),
:class:`SGLangConnectionError` (unreachable after the retries), :class:`SGLangWeightUpdateError`
(``{"success": false}`` from a weight endpoint).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = [
    "GenerateResult",
    "SGLangClient",
    "SGLangConnectionError",
    "SGLangError",
    "SGLangHTTPError",
    "SGLangProtocolError",
    "SGLangWeightUpdateError",
    "SSEParser",
    "WeightUpdateResult",
    "is_retryable_status",
    "pick_server",
]

ROUTING_HEADER = "X-SMG-Routing-Key"
_EXCERPT = 300


class SGLangError(Exception):
    """Base of every error this client raises."""


class SGLangHTTPError(SGLangError):
    """The server answered HTTP ``status`` with an error message in one of SGLang's error shapes."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class SGLangProtocolError(SGLangError):
    """The server answered something that is not SGLang's protocol (HTML, wrong JSON shape, bad SSE)."""

    def __init__(self, url: str, status: int, body_excerpt: str) -> None:
        super().__init__(f"{url}: HTTP {status}: not an SGLang answer: {body_excerpt!r}")
        self.url, self.status, self.body_excerpt = url, status, body_excerpt


class SGLangConnectionError(SGLangError):
    """The server could not be reached (or timed out) after ``attempts`` tries."""

    def __init__(self, url: str, attempts: int, cause: BaseException) -> None:
        super().__init__(f"{url}: unreachable after {attempts} attempt(s): {cause!r}")
        self.url, self.attempts, self.cause = url, attempts, cause


class SGLangWeightUpdateError(SGLangError):
    """A weight endpoint answered ``{"success": false, "message": ...}``."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: weight update failed: {message}")
        self.url, self.message = url, message


@dataclass(frozen=True)
class GenerateResult:
    """One generation (or one cumulative streaming chunk, ``finish_reason is None`` until the last)."""

    text: str
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: dict[str, Any] | None
    weight_version: str | None
    prompt_tokens: int
    completion_tokens: int
    token_weight_versions: list[str] | None
    rid: str | None = None
    index: int | None = None
    e2e_latency: float | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def finish_type(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` or ``None`` while running."""
        return None if self.finish_reason is None else str(self.finish_reason.get("type"))

    @classmethod
    def from_json(cls, url: str, status: int, obj: object) -> GenerateResult:
        """Validate one ``/generate`` result object; raise :class:`SGLangProtocolError` on a wrong shape."""
        if not isinstance(obj, dict) or "meta_info" not in obj or not isinstance(obj["meta_info"], dict):
            raise SGLangProtocolError(url, status, _excerpt(obj))
        meta: dict[str, Any] = obj["meta_info"]
        output_ids = obj.get("output_ids")
        text = obj.get("text", "")
        if not isinstance(output_ids, list) or not isinstance(text, str):
            raise SGLangProtocolError(url, status, _excerpt(obj))
        logprobs: list[float] | None = None
        entries = meta.get("output_token_logprobs")
        if entries is not None:
            try:
                logprobs = [float(e[0]) for e in entries]
            except (TypeError, ValueError, IndexError):
                raise SGLangProtocolError(url, status, _excerpt(obj)) from None
        finish = meta.get("finish_reason")
        if finish is not None and not isinstance(finish, dict):
            raise SGLangProtocolError(url, status, _excerpt(obj))
        versions = meta.get("output_token_weight_versions")
        return cls(
            text=text,
            output_ids=[int(t) for t in output_ids],
            logprobs=logprobs,
            finish_reason=finish,
            weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            token_weight_versions=None if versions is None else [str(v) for v in versions],
            rid=meta.get("id"),
            index=obj.get("index"),
            e2e_latency=meta.get("e2e_latency"),
            meta_info=meta,
        )


@dataclass(frozen=True)
class WeightUpdateResult:
    """A successful weight endpoint answer."""

    url: str
    message: str
    num_paused_requests: int | None = None


def _excerpt(obj: object) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, default=str)
    return text[:_EXCERPT]


def stable_hash(key: str) -> int:
    """A hash of ``key`` that is the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def pick_server(urls: Sequence[str], key: str) -> str:
    """The server that serves ``key``: stable across processes and restarts for the same url list."""
    return urls[stable_hash(key) % len(urls)]


def is_retryable_status(status: int) -> bool:
    """Statuses an idempotent call retries: overload, timeout and server errors."""
    return status in (408, 429) or status >= 500


def _error_message(obj: object) -> str | None:
    """The message of an SGLang error body (either shape), or ``None`` if ``obj`` is not one."""
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if obj.get("object") == "error" and isinstance(obj.get("message"), str):
            return str(obj["message"])
    return None


class SSEParser:
    """Incremental parser of a ``text/event-stream`` body: feed bytes, get the ``data`` payloads.

    Events end at a blank line; several ``data:`` lines of one event are joined with newlines;
    comments (``:``) and other fields are ignored; CRLF and LF line ends are both accepted.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            nl = self._buffer.find(b"\n")
            if nl < 0:
                return events
            line = self._buffer[:nl].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[nl + 1 :]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> list[str]:
        """Flush an event left without its terminating blank line."""
        events = self.feed(b"\n\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events


class SGLangClient:
    """Async client of one or more SGLang servers (or routers). Use ``async with`` or call :meth:`aclose`."""

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 5.0,
        session: aiohttp.ClientSession | None = None,
        api_key: str | None = None,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("SGLangClient needs at least one url")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._session = session
        self._own_session = session is None
        self._rr = itertools.count()
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._no_weight_version_endpoint: set[str] = set()  # servers that answered /get_weight_version 404

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
            self._own_session = True
        return self._session

    def _headers(self, key: str | None) -> dict[str, str]:
        """Headers of one call: the bearer key when configured, the routing key when given."""
        return {**self._auth, ROUTING_HEADER: key} if key is not None else dict(self._auth)

    def server_for(self, key: str | None) -> str:
        """The url a call with routing ``key`` goes to (round-robin without a key)."""
        if key is None:
            return self.urls[next(self._rr) % len(self.urls)]
        return pick_server(self.urls, key)

    # ------------------------------------------------------------------ transport

    async def _backoff(self, attempt: int) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        key: str | None = None,
        idempotent: bool = True,
        expect: str = "json",
    ) -> tuple[int, Any]:
        """One call with bounded retries; returns ``(status, parsed body)`` for 2xx answers."""
        headers = self._headers(key)
        attempts = self.retries + 1
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                async with self._http().request(method, url + path, json=body, headers=headers) as resp:
                    raw = await resp.read()
                    status = resp.status
            except aiohttp.ClientConnectorError as exc:  # nothing was sent: always safe to retry
                last = exc
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if not idempotent:
                    raise SGLangConnectionError(url, attempt + 1, exc) from exc
                last = exc
            else:
                if 200 <= status < 300:
                    return status, self._decode(url, status, raw, expect)
                retryable = is_retryable_status(status) if idempotent else status in (429, 503)
                if not retryable or attempt + 1 == attempts:
                    raise self._error(url, status, raw)
                last = self._error(url, status, raw)
            if attempt + 1 < attempts:
                await self._backoff(attempt)
        assert last is not None
        if isinstance(last, SGLangError):
            raise last
        raise SGLangConnectionError(url, attempts, last) from last

    @staticmethod
    def _decode(url: str, status: int, raw: bytes, expect: str) -> Any:
        if expect == "text":
            return raw.decode("utf-8", errors="replace")
        if expect == "none":
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SGLangProtocolError(url, status, raw[:_EXCERPT].decode("utf-8", errors="replace")) from None

    @staticmethod
    def _error(url: str, status: int, raw: bytes) -> SGLangError:
        """Classify a non-2xx answer: an SGLang error body is an HTTP error, anything else a protocol error."""
        text = raw.decode("utf-8", errors="replace")
        obj = _safe_json(raw)
        message = _error_message(obj)
        if message is None and isinstance(obj, dict) and "success" in obj and isinstance(obj.get("message"), str):
            message = obj["message"]  # weight endpoints: {"success": false, "message": ...}
        if message is None and status >= 500 and obj is None and text.strip() and "<html" not in text[:200].lower():
            message = text.strip()[:_EXCERPT]  # plain-text 5xx from a proxy or an overloaded server
        if message is None:
            return SGLangProtocolError(url, status, text[:_EXCERPT])
        return SGLangHTTPError(url, status, message)

    # ------------------------------------------------------------------ generate

    @staticmethod
    def _generate_body(
        input_ids: list[int] | None,
        text: str | None,
        sampling_params: Mapping[str, Any] | None,
        rid: str | None,
        return_logprob: bool,
        stream: bool,
        extra: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids and text")
        body: dict[str, Any] = {"sampling_params": dict(sampling_params or {}), "return_logprob": return_logprob}
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        else:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        if stream:
            body["stream"] = True
        body.update(extra or {})
        return body

    async def generate(
        self,
        input_ids: list[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None,
        key: str | None = None,
        return_logprob: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """One non-streaming generation; ``key`` (default: ``rid``) picks the server."""
        key = key if key is not None else rid
        url = self.server_for(key)
        body = self._generate_body(input_ids, text, sampling_params, rid, return_logprob, False, extra)
        status, obj = await self._request("POST", url, "/generate", body=body, key=key, idempotent=False)
        if isinstance(obj, list):
            if len(obj) != 1:
                raise SGLangProtocolError(url, status, _excerpt(obj))
            obj = obj[0]
        return GenerateResult.from_json(url, status, obj)

    async def generate_stream(
        self,
        input_ids: list[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None,
        key: str | None = None,
        return_logprob: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """Stream one generation: yields cumulative results, the last one with a ``finish_reason``.

        A mid-stream ``{"error": ...}`` event raises :class:`SGLangHTTPError`; a stream that ends without
        ``[DONE]`` or without a finished chunk raises :class:`SGLangProtocolError`.
        """
        key = key if key is not None else rid
        url = self.server_for(key)
        body = self._generate_body(input_ids, text, sampling_params, rid, return_logprob, True, extra)
        headers = self._headers(key)
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                resp = await self._http().post(url + "/generate", json=body, headers=headers)
            except aiohttp.ClientConnectorError as exc:
                if attempt + 1 == attempts:
                    raise SGLangConnectionError(url, attempts, exc) from exc
                await self._backoff(attempt)
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise SGLangConnectionError(url, attempt + 1, exc) from exc
            if resp.status in (429, 503) and attempt + 1 < attempts:
                resp.release()
                await self._backoff(attempt)
                continue
            break
        async with resp:
            if resp.status != 200:
                raise self._error(url, resp.status, await resp.read())
            if not resp.content_type.startswith("text/event-stream"):
                raise SGLangProtocolError(url, resp.status, (await resp.read())[:_EXCERPT].decode("utf-8", "replace"))
            parser = SSEParser()
            done = finished = False
            try:
                async for chunk in resp.content.iter_any():
                    for data in parser.feed(chunk):
                        if done:
                            continue
                        if data.strip() == "[DONE]":
                            done = True
                            continue
                        obj = _safe_json(data.encode())
                        message = _error_message(obj)
                        if message is not None:
                            raise SGLangHTTPError(url, resp.status, message)
                        result = GenerateResult.from_json(url, resp.status, obj if obj is not None else data)
                        finished = finished or result.finished
                        yield result
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                raise SGLangConnectionError(url, 1, exc) from exc
            if not done or not finished:
                raise SGLangProtocolError(url, resp.status, "stream ended before a finished chunk and [DONE]")

    # ------------------------------------------------------------------ control

    async def _all(self, path: str, body: Mapping[str, Any] | None = None, *, expect: str = "json") -> list[Any]:
        return [obj for _, obj in await asyncio.gather(*(self._request("POST", u, path, body=body, expect=expect) for u in self.urls))]

    async def abort(self, rid: str) -> None:
        """Abort requests whose rid starts with ``rid`` (on every server: the client may not know which)."""
        await self._all("/abort_request", {"rid": rid}, expect="none")

    async def abort_all(self) -> None:
        await self._all("/abort_request", {"abort_all": True}, expect="none")

    async def pause(self, mode: str = "abort") -> None:
        """``/pause_generation`` on every server; ``mode`` is ``abort``, ``retract`` or ``in_place``."""
        for obj in await self._all("/pause_generation", {"mode": mode}):
            self._check_status_ok(obj)

    async def continue_(self) -> None:
        for obj in await self._all("/continue_generation", {}):
            self._check_status_ok(obj)

    def _check_status_ok(self, obj: object) -> None:
        if not isinstance(obj, dict) or obj.get("status", "ok") != "ok":
            raise SGLangProtocolError(self.urls[0], 200, _excerpt(obj))

    async def flush_cache(self) -> None:
        await self._all("/flush_cache", expect="text")

    async def _weights(self, path: str, body: Mapping[str, Any]) -> list[WeightUpdateResult]:
        async def one(url: str) -> WeightUpdateResult:
            try:
                status, obj = await self._request("POST", url, path, body=body)
            except SGLangHTTPError as exc:
                raise SGLangWeightUpdateError(url, exc.message) from exc
            if not isinstance(obj, dict) or "success" not in obj:
                raise SGLangProtocolError(url, status, _excerpt(obj))
            if not obj["success"]:
                raise SGLangWeightUpdateError(url, str(obj.get("message", "")))
            return WeightUpdateResult(url, str(obj.get("message", "")), obj.get("num_paused_requests"))

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> list[WeightUpdateResult]:
        """Load new weights on every server from ``model_path`` (a path each server can read)."""
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._weights("/update_weights_from_disk", body)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> list[WeightUpdateResult]:
        """Join every server to the NCCL group the trainer broadcasts weights on."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weights("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
    ) -> list[WeightUpdateResult]:
        """Announce one bucket of tensors; SGLang returns after the trainer's NCCL broadcast completes."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._weights("/update_weights_from_distributed", body)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> list[WeightUpdateResult]:
        return await self._weights(
            "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )

    # ------------------------------------------------------------------ info

    async def model_info(self, url: str | None = None) -> dict[str, Any]:
        """``/model_info``, falling back to ``/get_model_info`` (older servers) on 404."""
        url = url or self.urls[0]
        try:
            status, obj = await self._request("GET", url, "/model_info")
        except SGLangError as exc:
            if getattr(exc, "status", None) != 404:
                raise
            status, obj = await self._request("GET", url, "/get_model_info")
        if not isinstance(obj, dict):
            raise SGLangProtocolError(url, status, _excerpt(obj))
        return obj

    async def get_weight_version(self, url: str | None = None) -> str:
        """The weight version ``url`` serves.

        ``GET /get_weight_version`` where the server has it; upstream SGLang v0.5.15 answers it 404 (slime
        patches it back), so on a 404 the version is read from ``/model_info`` (or ``/get_model_info``),
        whose ``weight_version`` field every SGLang since the endpoint's removal fills; the server is then
        remembered and asked ``/model_info`` directly from then on.
        """
        url = url or self.urls[0]
        if url not in self._no_weight_version_endpoint:
            try:
                status, obj = await self._request("GET", url, "/get_weight_version")
            except SGLangError as exc:
                if getattr(exc, "status", None) != 404:
                    raise
                self._no_weight_version_endpoint.add(url)
            else:
                if not isinstance(obj, dict) or "weight_version" not in obj:
                    raise SGLangProtocolError(url, status, _excerpt(obj))
                return str(obj["weight_version"])
        info = await self.model_info(url)
        if info.get("weight_version") is None:
            raise SGLangProtocolError(url, 200, "neither /get_weight_version nor a weight_version in /model_info: "
                                      + _excerpt(info))
        return str(info["weight_version"])

    async def get_weights_by_name(self, name: str, truncate_size: int = 100, *, url: str | None = None) -> list[Any]:
        """SGLang's ``/get_weights_by_name`` on one server: parameter ``name`` (its Hugging Face name; SGLang
        answers q/k/v and gate/up projections by slicing its fused tensors) cut to its first ``truncate_size``
        entries along the first dimension (rows of a 2-D weight, whole), as served, converted to float32, as a
        nested list; a server with several data-parallel ranks answers one such list per rank.

        A server without the endpoint answers 404 (405 behind some proxies); SGLang answers 400 ``Get parameter
        by name failed`` for a name its model does not have (or a model class without the method), the local
        server a 400 naming the parameter: all :class:`SGLangHTTPError` or :class:`SGLangProtocolError` with
        that ``status``. Anything but a list is an :class:`SGLangProtocolError`.
        """
        url = url or self.urls[0]
        status, obj = await self._request("POST", url, "/get_weights_by_name",
                                          body={"name": name, "truncate_size": truncate_size})
        if not isinstance(obj, list):
            raise SGLangProtocolError(url, status, _excerpt(obj))
        return obj

    async def server_info(self, url: str | None = None) -> dict[str, Any]:
        url = url or self.urls[0]
        status, obj = await self._request("GET", url, "/server_info")
        if not isinstance(obj, dict):
            raise SGLangProtocolError(url, status, _excerpt(obj))
        return obj

    async def health_generate(self, url: str | None = None) -> bool:
        """``True`` when ``/health_generate`` answers 200, ``False`` on 503 or an unreachable server."""
        url = url or self.urls[0]
        try:
            async with self._http().get(url + "/health_generate", headers=self._auth) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def wait_healthy(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        """Poll ``/health_generate`` on every server until all answer 200; raise ``TimeoutError`` after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for url in self.urls:
            while not await self.health_generate(url):
                if loop.time() >= deadline:
                    raise TimeoutError(f"{url} not healthy after {timeout}s")
                await asyncio.sleep(interval)


def _safe_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
