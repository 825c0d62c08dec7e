"""Weight sync of a real model through NATS: seconds per version, float32 vs bfloat16 on the wire,
and the adapter against raw nats-py, all in the same run against the same nats-server.

One version goes the whole way a learner's publication goes to a server, timed phase by phase:

- write: ``actors.learner.save_weights`` (``save_pretrained``, floating tensors in the wire dtype);
- publish: ``WeightPublisher.publish`` (objects streamed from the files, then the manifest in KV);
- fetch: ``WeightSubscriber`` sees the manifest and ``fetch`` streams the objects into files, digests checked;
- apply: ``LocalEngine.update_weights_from_disk`` into a float32 model (read, check, cast, swap).

``sync_seconds_*`` is the sum of the four. Raw nats-py: ``ObjectStore.put`` of the float32 version's
files from memory and ``ObjectStore.get`` with ``writeinto`` a file, the same bytes; ``adapter_vs_raw`` is raw
(put + get) seconds over adapter (publish + fetch) seconds of the float32 version, so above 1 means
the adapter is faster.

    python -m loadtests.weights [--quick] [--json out.json] [--nats URL] [--model-dir DIR] [--rounds N]

Every path runs ``--rounds`` times (3; 1 with --quick), the adapter and raw nats-py taking turns going
first; the figures are medians.

The model is ``--model-dir`` (default: ROLLOUT_MODEL_DIR, else the prepared SmolLM2-135M-Instruct of
the model cache); ``--quick`` uses a small synthetic model (~17 MB in float32) instead. With no
``--nats`` (or ROLLOUT_NATS_URL) it starts a private nats-server on a free port and stops it at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio


from modelserver.local.engine import LocalEngine  # noqa: E402
from actors.learner import save_weights  # noqa: E402
from modelserver.llm import load_model_dir, write_tiny_model_dir  # noqa: E402
from engine.config import NatsConfig  # noqa: E402
from engine.schemas import WeightManifest  # noqa: E402
from engine.topics import Names  # noqa: E402
from streams.nats import Nats  # noqa: E402
from streams.weights import WeightPublisher, WeightSubscriber  # noqa: E402

QUICK_MODEL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 1024}
"""The synthetic model of --quick: ~4.3M parameters, ~17 MB in float32."""


def default_model_dir() -> str | None:
    if os.environ.get("ROLLOUT_MODEL_DIR"):
        return os.environ["ROLLOUT_MODEL_DIR"]
    try:
        from modelserver.prepare import cached_model_dir  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(cached_model_dir("smollm2-135m"))


async def sync_one_version(nats: Nats, names: Names, manifests: AsyncIterator[WeightManifest],
                           sub: WeightSubscriber, learner_model, engine: LocalEngine, version: int, dtype: str,
                           work: Path) -> dict:
    """One version from the learner's model into the server's, phase by phase; returns the timings.

    ``manifests`` is the subscriber's watch, open since before the first publication (as an inference
    actor's is), so fetch time runs from the end of the publication to the files on disk.
    """
    out_dir = work / f"write-v{version}"
    out_dir.mkdir()
    t0 = time.perf_counter()
    files = await anyio.to_thread.run_sync(save_weights, learner_model, out_dir, dtype, engine.tokenizer)
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = await WeightPublisher(nats, names).publish(version, files)
    t_publish = time.perf_counter() - t0
    t0 = time.perf_counter()
    with anyio.fail_after(60):
        while (announced := await anext(manifests)).version != version:
            pass
    vdir = await sub.fetch(announced)
    t_fetch = time.perf_counter() - t0
    t0 = time.perf_counter()
    await engine.update_weights_from_disk(str(vdir), weight_version=str(version))
    t_apply = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    shutil.rmtree(vdir)  # a few versions of a real model would fill a small disk
    assert manifest.wire_dtype == dtype, manifest.wire_dtype
    size = sum(o["size"] for o in manifest.objects)
    print(f"{dtype}: {size / 1e6:.1f} MB, write {t_write:.2f} s, publish {t_publish:.2f} s, fetch {t_fetch:.2f} s, "
          f"apply {t_apply:.2f} s", flush=True)
    return {"bytes": size, "write_s": t_write, "publish_s": t_publish, "fetch_s": t_fetch, "apply_s": t_apply,
            "sync_s": t_write + t_publish + t_fetch + t_apply}


def fp32_files(model, tokenizer, work: Path) -> list[Path]:
    """The float32 version's files, as the learner writes them (written once, for the raw path)."""
    out_dir = work / "raw-source"
    if not out_dir.is_dir():
        out_dir.mkdir()
        save_weights(model, out_dir, "float32", tokenizer)  # the same bytes as the adapter's float32 version
    return sorted(p for p in out_dir.iterdir() if p.is_file())


async def raw_put_get(nats: Nats, files: list[Path], work: Path) -> tuple[float, float, int]:
    """nats-py's own ObjectStore.put (from memory) and .get (``writeinto`` a file) of ``files``;
    returns (put_s, get_s, bytes).

    ``writeinto``, not nats-py's default get into memory: that one grows the object with ``bytes +=``
    per 128 KiB chunk, quadratic in the size (a 538 MB object did not arrive in 15 minutes here).
    """
    store = await nats.object_store(f"raw-{uuid.uuid4().hex[:6]}")  # made before anything is timed
    put_s = get_s = 0.0
    size = 0
    for f in files:
        data = f.read_bytes()
        size += len(data)
        t0 = time.perf_counter()
        await store.put(f.name, data)
        put_s += time.perf_counter() - t0
        copy = work / f"raw-{f.name}"
        with open(copy, "wb") as sink:
            t0 = time.perf_counter()
            await store.get(f.name, writeinto=sink)
            get_s += time.perf_counter() - t0
        assert copy.read_bytes() == data, f"raw get of {f.name} returned other bytes"
        copy.unlink()
        print(f"raw nats-py {f.name}: {len(data) / 1e6:.1f} MB, put {put_s:.2f} s, get {get_s:.2f} s (so far)", flush=True)
        del data
        await store.delete(f.name)
        gc.collect()
    return put_s, get_s, size


@contextlib.contextmanager
def _nats_url(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from loadtests._infra import private_nats  # started on a free port, stopped by pid

    with private_nats() as started:
        yield started


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="rollout-weights-bench-") as tmp:
        work = Path(tmp)
        if args.quick:
            model_dir = write_tiny_model_dir(work / "model", seed=0, **QUICK_MODEL)
            label = "synthetic model (--quick)"
        else:
            model_dir = Path(args.model_dir or default_model_dir() or "")
            if not (model_dir / "config.json").is_file():
                raise SystemExit(f"no model directory at {str(model_dir)!r}: pass --model-dir, set ROLLOUT_MODEL_DIR "
                                 "or run `rollout model prepare smollm2-135m`")
            label = str(model_dir)
        learner_model, _ = load_model_dir(model_dir)
        served, tokenizer = load_model_dir(model_dir)
        n_params = sum(p.numel() for p in learner_model.parameters())
        engine = LocalEngine(served, tokenizer)
        await engine.start()
        names = Names(f"bench-{uuid.uuid4().hex[:6]}")
        out: dict = {"model": label, "parameters": n_params}
        try:
            with _nats_url(args.nats) as url:
                async with Nats(NatsConfig(url=url, timeout_s=120)) as nats:
                    # buckets made and the watch open before anything is timed, on both paths
                    await nats.object_store(names.bucket("weights"))
                    await nats.kv(names.bucket("control"))
                    sub = WeightSubscriber(nats, names, work / "fetched", timeout_s=600)
                    async with contextlib.aclosing(sub.manifests()) as manifests:
                        # rounds alternate which path goes first, so neither always meets a warm server;
                        # each figure is the median over the rounds
                        fp32s, bf16s, raws = [], [], []
                        for r in range(args.rounds):
                            async def adapter() -> None:
                                fp32s.append(await sync_one_version(nats, names, manifests, sub, learner_model,
                                                                    engine, 2 * r + 1, "float32", work))

                            async def raw() -> None:
                                raws.append(await raw_put_get(nats, fp32_files(learner_model, tokenizer, work), work))

                            for path in ((adapter, raw) if r % 2 == 0 else (raw, adapter)):
                                await path()
                            bf16s.append(await sync_one_version(nats, names, manifests, sub, learner_model, engine,
                                                                2 * r + 2, "bfloat16", work))
        finally:
            await engine.aclose()
    fp32 = {k: statistics.median(x[k] for x in fp32s) for k in fp32s[0]}
    bf16 = {k: statistics.median(x[k] for x in bf16s) for k in bf16s[0]}
    put_s, get_s = statistics.median(x[0] for x in raws), statistics.median(x[1] for x in raws)
    raw_bytes = raws[0][2]
    out["rounds"] = args.rounds
    assert raw_bytes == fp32["bytes"]
    rows = []
    for name, res in (("float32", fp32), ("bfloat16", bf16)):
        mb = res["bytes"] / 1e6
        rows.append((f"adapter {name}", mb, res["write_s"], res["publish_s"], res["fetch_s"], res["apply_s"],
                     res["sync_s"], mb / res["publish_s"], mb / res["fetch_s"]))
    mb = raw_bytes / 1e6
    rows.append(("raw nats-py float32", mb, None, put_s, get_s, None, None, mb / put_s, mb / get_s))
    out.update({
        "sync_seconds_fp32": round(fp32["sync_s"], 3),
        "sync_seconds_bf16": round(bf16["sync_s"], 3),
        "publish_mbps": round(fp32["bytes"] / 1e6 / fp32["publish_s"], 1),
        "fetch_mbps": round(fp32["bytes"] / 1e6 / fp32["fetch_s"], 1),
        "raw_put_mbps": round(mb / put_s, 1),
        "raw_get_mbps": round(mb / get_s, 1),
        "adapter_vs_raw": round((put_s + get_s) / (fp32["publish_s"] + fp32["fetch_s"]), 3),
        "bf16_over_fp32_sync": round(bf16["sync_s"] / fp32["sync_s"], 3),
        "publish_mbps_bf16": round(bf16["bytes"] / 1e6 / bf16["publish_s"], 1),
        "fetch_mbps_bf16": round(bf16["bytes"] / 1e6 / bf16["fetch_s"], 1),
        "wire_mb_fp32": round(fp32["bytes"] / 1e6, 1),
        "wire_mb_bf16": round(bf16["bytes"] / 1e6, 1),
    })
    for name, res in (("fp32", fp32), ("bf16", bf16)):
        for phase in ("write_s", "publish_s", "fetch_s", "apply_s"):
            out[f"{phase[:-2]}_seconds_{name}"] = round(res[phase], 3)

    def cell(v: float | None, fmt: str) -> str:
        return format(v, fmt) if v is not None else format("-", ">" + fmt.split(".")[0])

    print(f"model: {label} ({n_params / 1e6:.1f}M parameters)")
    print(f"{'path':<22}{'MB':>8}{'write s':>9}{'publish s':>11}{'fetch s':>9}{'apply s':>9}{'sync s':>9}"
          f"{'put MB/s':>10}{'get MB/s':>10}")
    for name, size, w, p, f, a, s, pm, gm in rows:
        print(f"{name:<22}{size:>8.1f}{cell(w, '9.2f')}{p:>11.2f}{f:>9.2f}{cell(a, '9.2f')}{cell(s, '9.2f')}"
              f"{pm:>10.1f}{gm:>10.1f}")
    print("\nheadline:", {k: out[k] for k in ("sync_seconds_fp32", "sync_seconds_bf16", "publish_mbps", "fetch_mbps",
                                            "raw_put_mbps", "raw_get_mbps", "adapter_vs_raw")})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small synthetic model: a smoke run under a minute")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    p.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL"))
    p.add_argument("--rounds", type=int, default=None, help="rounds of every path (default 3, 1 with --quick)")
    p.add_argument("--model-dir", help="HF model directory (default: ROLLOUT_MODEL_DIR or the model cache)")
    args = p.parse_args()

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # `timeout` and `kill` send SIGTERM: as KeyboardInterrupt it unwinds, so the private nats-server is
    # stopped and the temporary directories (a GB or more with a real model) are removed
    signal.signal(signal.SIGTERM, interrupt)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    out = anyio.run(main_async, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
