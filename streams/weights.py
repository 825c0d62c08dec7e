"""Weight versions over NATS: safetensors files in the object store, a manifest in KV.

Publish order is the protocol: every object is stored first, then the manifest is put under
``Names.WEIGHTS_KEY``; the KV update is the announcement, so a watcher never sees a version whose
objects are missing. Fetches check each object's sha256 against the manifest.

A version is a whole Hugging Face model directory, not only its tensors: ``config.json``, the
safetensors (one file, or shards with ``model.safetensors.index.json``) and the tokenizer files
(``tokenizer_config.json`` with ``tokenizer.json`` or ``tokenizer.model``). The fetched ``v<N>/`` is then
what SGLang's ``/update_weights_from_disk`` reads (its loader takes every ``*.safetensors`` the index
names, by the Hugging Face tensor names) and also what ``--model-path`` or the local server can start
from. :func:`check_hf_dir` refuses a fetched version that is not complete, naming what is missing.

Both buckets are the connection's configured ones (``nats.weights_bucket``, ``nats.kv_bucket``, each
prefixed by the namespace): publisher and subscriber read them from the control store (``Nats``) they are given, so no
user of the weights can name a bucket the rest of the deployment does not use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anyio

from engine.schemas import WeightManifest
from engine.topics import Names
from streams.codec import DecodeError, decode, encode
from streams.nats import NatsError
from streams.protocols import ControlStore

log = logging.getLogger("rollout.streams.weights")


class IncompleteModelDir(ValueError):
    """A weight version's directory lacks files a Hugging Face loader needs; ``missing`` names them."""

    def __init__(self, path: Path, missing: list[str]) -> None:
        super().__init__(f"{path}: not a complete Hugging Face model directory: missing {', '.join(missing)}")
        self.path, self.missing = path, missing


SAFETENSORS_INDEX = "model.safetensors.index.json"


def check_hf_dir(path: str | Path) -> None:
    """Raise :class:`IncompleteModelDir` unless ``path`` has a config, every weight file and a tokenizer."""
    path = Path(path)
    missing: list[str] = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise IncompleteModelDir(path, [f"a readable {SAFETENSORS_INDEX} (it has no weight_map)"]) from None
        missing += [f"{shard} (named by {SAFETENSORS_INDEX})" for shard in shards if not (path / shard).is_file()]
    elif not any(path.glob("*.safetensors")):
        missing.append("model.safetensors (or shards with " + SAFETENSORS_INDEX + ")")
    if not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        missing.append("tokenizer.json (or tokenizer.model)")
    if missing:
        raise IncompleteModelDir(path, missing)


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
    def __init__(self, nats: ControlStore, names: Names, producer: str = "learner") -> None:
        self.nats = nats
        self.names = names
        self.producer = producer
        self.bucket = names.bucket(nats.cfg.weights_bucket)
        self.kv_bucket = names.bucket(nats.cfg.kv_bucket)

    async def publish(self, version: int, files: list[str | Path], step: int = 0, keep: int = 3) -> WeightManifest:
        """Store ``files`` (a model directory's files, flat) as version ``version``, then announce it.

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

    def __init__(self, nats: ControlStore, names: Names, dest: str | Path, timeout_s: float = 60.0) -> None:
        self.nats = nats
        self.names = names
        self.dest = Path(dest)
        self.timeout_s = timeout_s
        self.bucket = names.bucket(nats.cfg.weights_bucket)
        self.kv_bucket = names.bucket(nats.cfg.kv_bucket)

    async def manifests(self) -> AsyncGenerator[WeightManifest, None]:
        # closed with this generator, not whenever the garbage collector finds it (by then the connection
        # may be draining, and stopping the watch fails in a task nobody awaits)
        async with contextlib.aclosing(self.nats.kv_watch(self.kv_bucket, Names.WEIGHTS_KEY)) as updates:
            async for raw in updates:
                m = _manifest(raw)
                if m is not None:
                    yield m

    async def fetch(self, manifest: WeightManifest) -> Path:
        """Download every object of ``manifest``; returns the version's directory.

        Raises :class:`IncompleteModelDir` when the version is not a complete model directory (see
        the module docstring), before anything is asked to load it.
        """
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
        check_hf_dir(vdir)
        return vdir


async def fetch_latest_model(nats: ControlStore, names: Names, base_dir: str | Path, fetch_dir: Path,
                             out_dir: Path) -> tuple[WeightManifest, Path] | None:
    """The latest published version as a model directory ``out_dir``: ``base_dir``'s files (config, tokenizer,
    generation config) overlaid with the version's; None when nothing is published. The version is fetched
    (digests checked) under ``fetch_dir``; NatsError / IncompleteModelDir as :meth:`WeightSubscriber.fetch`."""
    import shutil

    manifest = await WeightPublisher(nats, names).latest()
    if manifest is None:
        return None
    vdir = await WeightSubscriber(nats, names, fetch_dir).fetch(manifest)
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(base_dir, out_dir)
    for f in vdir.iterdir():
        shutil.copy2(f, out_dir / f.name)
    return manifest, out_dir
