"""NATS JetStream adapter: object store that streams through files, KV put / get / watch.

Large objects never pass through one message or one ``bytes`` value: ``put_file`` reads the file in
128 KiB chunks and publishes them with up to ``PUT_WINDOW`` acknowledgements outstanding, and
``get_file`` writes chunks into a file as they come, answering the server's flow control. Both keep
nats-py's object layout (any client reads what they write) but not its ``get`` / ``put``, which stall
on flow control, wait a round trip per chunk, and leave a subscription or chunks behind when cut
short (docs/architecture.md, "Weights"). Every operation has a hard timeout and raises ``NatsError``
naming what timed out.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import datetime
import hashlib
import importlib.util
import io
import json
import os
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import Header, KeyValueConfig, ObjectInfo, ObjectMetaOptions, ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import (MSG_ROLLUP_SUBJECT, OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DEFAULT_CHUNK_SIZE, OBJ_DIGEST_TEMPLATE,
                                  OBJ_DIGEST_TYPE, OBJ_META_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, ObjectStore)

from engine.config import NatsConfig, check_files
from streams.protocols import TransportError


PUT_WINDOW = 64
"""Object chunks (128 KiB each) a write keeps unacknowledged: 8 MiB in flight."""
BucketT = TypeVar("BucketT")
"""A JetStream bucket handle: an object store or a key-value bucket."""


class NatsError(TransportError):
    """A NATS operation that failed or timed out; the message says which."""


def connect_options(cfg: NatsConfig) -> dict[str, Any]:
    opts: dict[str, Any] = {"servers": cfg.url.split(","), "connect_timeout": min(cfg.timeout_s, 10.0),
                            "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5,
                            "allow_reconnect": True}
    if cfg.credentials:
        # nats-py imports nkeys only once connecting, where its absence ends in an obscure error
        if importlib.util.find_spec("nkeys") is None:
            raise NatsError(f"nats.credentials={cfg.credentials} needs the nkeys package, which is not installed: "
                            "pip install nkeys")
        opts["user_credentials"] = cfg.credentials
    if cfg.user:
        opts["user"], opts["password"] = cfg.user, cfg.password
    if cfg.token:
        opts["token"] = cfg.token
    return opts


class Nats:
    """One connection plus JetStream helpers; ``async with Nats(cfg) as n``."""

    def __init__(self, cfg: NatsConfig) -> None:
        self.cfg = cfg
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self._object_stores: dict[str, ObjectStore] = {}
        self._kvs: dict[str, KeyValue] = {}

    async def connect(self) -> "Nats":
        last_error: list[Exception] = []

        async def _err(exc: Exception) -> None:  # nats-py reports (re)connect errors through this callback
            # the server's own word ("Authorization Violation") outranks the socket reset that follows it
            if not last_error or isinstance(last_error[0], OSError) or not isinstance(exc, OSError):
                last_error[:] = [exc]

        check_files(self.cfg)  # nats-py reads the credentials only after connecting (and hangs on a bad file)
        options = connect_options(self.cfg)
        nc = Client()
        try:
            with anyio.fail_after(self.cfg.timeout_s):
                # The first connect must not retry forever: fail fast with a clear error.
                await nc.connect(**options, error_cb=_err)
        except BaseException as exc:
            # A connect given up on leaves nats-py's socket and tasks behind unless closed. One that failed
            # before nats-py set itself up (e.g. reading credentials) has nothing to close, and nats-py's
            # close would fail there with "Client.connect must be called first", hiding the real error.
            if nc._flush_queue is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await nc.close()
            if isinstance(exc, TimeoutError):
                # nats-py retries a refused login ("Authorization Violation") until the timeout: say why.
                why = f": last error: {type(last_error[0]).__name__}: {last_error[0]}" if last_error else ""
                raise NatsError(f"could not connect to NATS at {self.cfg.url} within {self.cfg.timeout_s}s{why}") from None
            if isinstance(exc, Exception):  # nats-py raises many unrelated types on connect
                raise NatsError(f"could not connect to NATS at {self.cfg.url}: {type(exc).__name__}: {exc}") from exc
            raise
        self.nc = nc
        self.js = self.nc.jetstream(timeout=self.cfg.timeout_s)
        return self

    async def __aenter__(self) -> "Nats":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Drain and close; idempotent."""
        nc, self.nc = self.nc, None
        if nc is not None and not nc.is_closed:
            with anyio.move_on_after(5):
                await nc.drain()
            if not nc.is_closed:
                await nc.close()

    def _jetstream(self) -> JetStreamContext:
        if self.js is None:
            raise NatsError("not connected")
        return self.js

    async def _bucket(self, cache: dict[str, BucketT], bucket: str,
                      bind: Callable[[JetStreamContext], Awaitable[BucketT]],
                      create: Callable[[JetStreamContext], Awaitable[BucketT]]) -> BucketT:
        """``cache[bucket]``, else the bucket bound within the timeout (made with ``create`` if it does not exist)."""
        if bucket not in cache:
            js = self._jetstream()
            with anyio.fail_after(self.cfg.timeout_s):
                try:
                    cache[bucket] = await bind(js)
                except (BucketNotFoundError, NotFoundError):
                    cache[bucket] = await create(js)
        return cache[bucket]

    # -- object store ------------------------------------------------------------------------------
    async def object_store(self, bucket: str) -> ObjectStore:
        return await self._bucket(
            self._object_stores, bucket, lambda js: js.object_store(bucket),
            lambda js: js.create_object_store(bucket, ObjectStoreConfig(bucket=bucket, storage=StorageType.FILE)))

    async def put_file(self, bucket: str, name: str, path: str | Path, timeout_s: float | None = None) -> dict[str, Any]:
        """Stream a file into the object store; returns {name, size, sha256}."""
        store = await self.object_store(bucket)
        timeout = timeout_s or max(self.cfg.timeout_s, os.path.getsize(path) / (20 * 1024 * 1024))
        try:
            with anyio.fail_after(timeout), open(path, "rb") as f:
                size, sha = await self._write_object(store, bucket, name, f.read)
        except TimeoutError:
            raise NatsError(f"put of {name} into {bucket} timed out after {timeout:.0f}s") from None
        return {"name": name, "size": size, "sha256": sha}

    async def _write_object(self, store: ObjectStore, bucket: str, name: str,
                            read: Callable[[int], bytes]) -> tuple[int, str]:
        """Write object ``name`` from ``read`` (called in a worker thread); returns (size, sha256 hex).

        The same layout as nats-py's ``ObjectStore.put`` (chunks of 128 KiB under a fresh id, then the
        metadata message as a roll-up, then the old version's chunks purged), so any client reads it;
        but the chunks are published with up to ``PUT_WINDOW`` acknowledgements outstanding rather than
        one round trip each, and the store's digest (SHA-256) is the one the caller gets back: the file
        is read once. A write that fails or is cancelled purges the chunks it sent.
        """
        js = self._jetstream()
        try:
            existing: ObjectInfo | None = await store.get_info(name)
        except NotFoundError:
            existing = None
        nuid = uuid.uuid4().hex
        chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
        stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        digest, size, chunks = hashlib.sha256(), 0, 0
        acks: collections.deque[asyncio.Future[Any]] = collections.deque()
        try:
            while data := await anyio.to_thread.run_sync(read, OBJ_DEFAULT_CHUNK_SIZE):
                digest.update(data)
                size, chunks = size + len(data), chunks + 1
                with anyio.CancelScope(shield=True):  # a chunk sent is a chunk whose ack is waited for
                    acks.append(await js.publish_async(chunk_subject, data))
                if len(acks) >= PUT_WINDOW:
                    await acks.popleft()  # raises the server's error for that chunk, if any
            while acks:
                await acks.popleft()
            info = ObjectInfo(
                name=name, bucket=bucket, nuid=nuid, size=size, chunks=chunks,
                mtime=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(digest.digest()).decode()),
                options=ObjectMetaOptions(max_chunk_size=OBJ_DEFAULT_CHUNK_SIZE))
            meta_subject = OBJ_META_PRE_TEMPLATE.format(bucket=bucket,
                                                        obj=base64.urlsafe_b64encode(name.encode()).decode())
            with anyio.CancelScope(shield=True):  # a metadata message sent half-way could outlive the purge
                await js.publish(meta_subject, json.dumps(info.as_dict()).encode(),
                                 headers={Header.ROLLUP: MSG_ROLLUP_SUBJECT})
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2 * self.cfg.timeout_s):
                # Every chunk sent is stored (acknowledged) before the purge: the purge is handled apart
                # from the stream's intake and could otherwise run ahead of a chunk and leave it behind.
                for ack in acks:
                    with contextlib.suppress(Exception):
                        await ack
                with contextlib.suppress(Exception):
                    await js.purge_stream(stream, subject=chunk_subject)
            raise
        if existing is not None and not existing.deleted:
            with contextlib.suppress(NotFoundError):
                await js.purge_stream(stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=existing.nuid))
        return size, digest.hexdigest()

    async def put_bytes(self, bucket: str, name: str, data: bytes) -> dict[str, Any]:
        store = await self.object_store(bucket)
        with anyio.fail_after(self.cfg.timeout_s):
            size, sha = await self._write_object(store, bucket, name, io.BytesIO(data).read)
        return {"name": name, "size": size, "sha256": sha}

    async def get_file(self, bucket: str, name: str, path: str | Path, *, sha256: str | None = None,
                       timeout_s: float | None = None) -> int:
        """Stream an object into a file; checks its sha256 when given. Returns the size."""
        store = await self.object_store(bucket)
        timeout = timeout_s or self.cfg.timeout_s * 4
        tmp = Path(f"{path}.part")
        try:
            try:
                with anyio.fail_after(timeout):
                    with open(tmp, "wb") as f:
                        got = await self._read_object(store, bucket, name, f.write)
            except TimeoutError:
                raise NatsError(f"get of {name} from {bucket} timed out after {timeout:.0f}s") from None
            except NotFoundError:
                raise NatsError(f"object {name} not found in bucket {bucket}") from None
            if sha256 is not None and got != sha256:
                raise NatsError(f"object {name}: sha256 {got} does not match the manifest's {sha256}")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        return os.path.getsize(path)

    async def _read_object(self, store: ObjectStore, bucket: str, name: str,
                           write: Callable[[bytes], object]) -> str:
        """Stream object ``name``'s chunks to ``write`` (in a worker thread), check the store's digest
        and return it (SHA-256, hex).

        nats-py's ``ObjectStore.get`` unsubscribes its chunk consumer only when the last chunk has
        arrived: cancelled or failed half-way (a timeout, a shutdown, a failing write) it leaves the
        subscription behind, buffering the rest of the object in this process and holding up ``drain``
        at close. Here the subscription ends with the read, however it ends.
        """
        info = await store.get_info(name)
        if not info.nuid:
            raise NatsError(f"object {name} in {bucket} has no chunk id in its metadata")
        if info.is_link():
            raise NatsError(f"object {name} in {bucket} is a link; links are not followed")
        if not info.size:
            return hashlib.sha256().hexdigest()
        sub = await self._jetstream().subscribe(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid),
                                                ordered_consumer=True)
        digest = hashlib.sha256()
        try:
            while True:
                # next_msg, not the message iterator: it answers the server's flow-control requests,
                # without which delivery stalls about 250 ms every 2 MiB (docs/architecture.md, Weights)
                try:
                    msg = await sub.next_msg(timeout=self.cfg.timeout_s)
                except nats.errors.TimeoutError:
                    raise NatsError(f"object {name} in {bucket}: no chunk for {self.cfg.timeout_s}s") from None
                digest.update(msg.data)
                await anyio.to_thread.run_sync(write, msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                with contextlib.suppress(Exception):  # a closed connection has dropped it already
                    await sub.unsubscribe()
        want = (info.digest or "").removeprefix(OBJ_DIGEST_TYPE).removeprefix(OBJ_DIGEST_TYPE.upper())
        try:
            expected = base64.urlsafe_b64decode(want + "=" * (-len(want) % 4))
        except ValueError:
            raise NatsError(f"object {name} in {bucket}: unreadable digest {info.digest!r} in its metadata") from None
        if digest.digest() != expected:
            raise NatsError(f"object {name} in {bucket}: the chunks' SHA-256 does not match the store's digest")
        return digest.hexdigest()

    async def delete_object(self, bucket: str, name: str) -> None:
        store = await self.object_store(bucket)
        with anyio.fail_after(self.cfg.timeout_s):
            try:
                await store.delete(name)
            except NotFoundError:
                pass

    # -- key-value ---------------------------------------------------------------------------------
    async def kv(self, bucket: str, history: int = 1) -> KeyValue:
        return await self._bucket(
            self._kvs, bucket, lambda js: js.key_value(bucket),
            lambda js: js.create_key_value(KeyValueConfig(bucket=bucket, history=history, storage=StorageType.FILE)))

    async def kv_put(self, bucket: str, key: str, value: bytes) -> int:
        kv = await self.kv(bucket)
        with anyio.fail_after(self.cfg.timeout_s):
            return await kv.put(key, value)

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        kv = await self.kv(bucket)
        with anyio.fail_after(self.cfg.timeout_s):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                return None
        return entry.value

    async def kv_watch(self, bucket: str, key: str) -> AsyncGenerator[bytes, None]:
        """Yield the current value (if any) and every later update of ``key``."""
        kv = await self.kv(bucket)
        watcher = await kv.watch(key)
        try:
            async for entry in watcher:
                if entry is None:  # the marker after the initial values
                    continue
                if entry.value is None or entry.operation is not None:
                    continue  # deletes and purges
                yield entry.value
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves KeyWatcher.stop unannotated
