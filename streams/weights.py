"""Weight versions over NATS: safetensors files in the object store, a manifest in KV.

Publish order is the protocol: every object is stored first, then the manifest is put under
``Names.WEIGHTS_KEY``; the KV update is the announcement, so a watcher never sees a version whose
objects are missing. Fetches check each object's sha256 against the manifest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from engine.schemas import WeightManifest
from engine.topics import Names
from streams.codec import DecodeError, decode, encode
from streams.nats import Nats, NatsError

log = logging.getLogger("rollout.streams.weights")


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The tensor table of a safetensors file (dtype, shape per tensor) without loading it."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in header.items()}


SAFETENSORS_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                            "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
"""safetensors header dtype -> torch dtype name, for the floating dtypes."""


def wire_dtype(tensors: dict[str, Any]) -> str:
    """The one floating dtype of a tensor table (``mixed`` if several; ``float32`` if there are none)."""
    found = {SAFETENSORS_FLOAT_DTYPES[t["dtype"]] for t in tensors.values() if t["dtype"] in SAFETENSORS_FLOAT_DTYPES}
    if len(found) > 1:
        return "mixed"
    return found.pop() if found else "float32"


class WeightPublisher:
    def __init__(self, nats: Nats, names: Names, producer: str = "learner") -> None:
        self.nats = nats
        self.names = names
        self.producer = producer
        self.bucket = names.bucket("weights")
        self.kv_bucket = names.bucket("control")

    async def publish(self, version: int, files: list[str | Path], step: int = 0, keep: int = 3) -> WeightManifest:
        """Store ``files`` (safetensors) as version ``version``, then announce it.

        The files go as they are: their tensors' dtype is the wire dtype (``learner.publish_dtype`` decides
        it when the learner writes them), recorded in the manifest as ``wire_dtype``.
        """
        objects = []
        tensors: dict[str, Any] = {}
        for path in files:
            path = Path(path)
            name = f"v{version}/{path.name}"
            objects.append(await self.nats.put_file(self.bucket, name, path))
            if path.suffix == ".safetensors":
                tensors.update(safetensors_header(path))
        manifest = WeightManifest(version=version, objects=objects, tensors=tensors, step=step,
                                  wire_dtype=wire_dtype(tensors))
        value, _ = encode(manifest, producer=self.producer)
        await self.nats.kv_put(self.kv_bucket, Names.WEIGHTS_KEY, value)
        if keep and version - keep >= 0:
            await self._delete_version(version - keep, [Path(p).name for p in files])
        return manifest

    async def _delete_version(self, version: int, file_names: list[str]) -> None:
        for fname in file_names:
            await self.nats.delete_object(self.bucket, f"v{version}/{fname}")

    async def latest(self) -> WeightManifest | None:
        raw = await self.nats.kv_get(self.kv_bucket, Names.WEIGHTS_KEY)
        return _manifest(raw) if raw else None


def _manifest(raw: bytes) -> WeightManifest | None:
    try:
        env = decode(raw, expect=("weight_manifest",))
    except DecodeError as exc:
        log.error("ignoring an undecodable weight manifest: %s", exc)
        return None
    return env.message  # type: ignore[return-value]


class WeightSubscriber:
    """Watches the weights key; fetches each new version into ``dest/v<N>/`` with digests checked."""

    def __init__(self, nats: Nats, names: Names, dest: str | Path, timeout_s: float = 60.0) -> None:
        self.nats = nats
        self.names = names
        self.dest = Path(dest)
        self.timeout_s = timeout_s
        self.bucket = names.bucket("weights")
        self.kv_bucket = names.bucket("control")

    async def manifests(self) -> AsyncIterator[WeightManifest]:
        # closed with this generator, not whenever the garbage collector finds it (by then the connection
        # may be draining, and stopping the watch fails in a task nobody awaits)
        async with contextlib.aclosing(self.nats.kv_watch(self.kv_bucket, Names.WEIGHTS_KEY)) as updates:
            async for raw in updates:
                m = _manifest(raw)
                if m is not None:
                    yield m

    async def fetch(self, manifest: WeightManifest) -> Path:
        """Download every object of ``manifest``; returns the version's directory."""
        vdir = self.dest / f"v{manifest.version}"
        vdir.mkdir(parents=True, exist_ok=True)
        try:
            with anyio.fail_after(self.timeout_s):
                for obj in manifest.objects:
                    fname = obj["name"].split("/", 1)[-1]
                    await self.nats.get_file(self.bucket, obj["name"], vdir / fname, sha256=obj.get("sha256"),
                                             timeout_s=self.timeout_s)
        except TimeoutError:
            raise NatsError(f"fetching weight version {manifest.version} took longer than {self.timeout_s}s") from None
        return vdir
