"""Checks of a model directory (or GGUF file) before anything loads it.

A model directory that is wrong in some way makes transformers fail deep inside ``from_pretrained``,
often minutes into a daemon's start, with a message about the symptom rather than the file.
:func:`check_model_dir` reads only small files (``config.json``, the tokenizer config, a sharded
index, a GGUF header) and raises :class:`ModelDirError` naming the file and what is wrong, so the CLI
can refuse a bad directory before any daemon starts. It imports neither torch nor transformers.

What a loadable directory has (Hugging Face layout):

- ``config.json``, parsable, whose ``architectures`` names one of :data:`SUPPORTED_ARCHITECTURES`;
- weights: ``model.safetensors``, or ``model.safetensors.index.json`` whose every shard exists;
- a tokenizer: ``tokenizer.json``, or ``tokenizer.model`` (SentencePiece), or ``vocab.json`` +
  ``merges.txt``;
- where the prompts are rendered with it, a chat template: ``chat_template.jinja`` (transformers 5
  writes this) or a ``chat_template`` entry in ``tokenizer_config.json`` (older writers);
- a context window (``max_position_embeddings``) at least as long as the prompt budget.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "ModelDirError",
    "check_config_model_dir",
    "check_gguf",
    "check_model_dir",
    "gguf_architecture",
    "has_chat_template",
]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
"""Hugging Face classes the model layer serves and trains (config.json ``architectures``)."""

GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "mistral": "MistralForCausalLM"}
"""GGUF ``general.architecture`` -> the Hugging Face class transformers dequantises it into."""

SAFETENSORS_INDEX = "model.safetensors.index.json"


class ModelDirError(ValueError):
    """A model directory or GGUF file that cannot be loaded; ``path`` is the offending file."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def check_model_dir(path: str | os.PathLike[str], *, need_chat_template: bool = False,
                    min_context: int | None = None) -> dict[str, Any]:
    """Raise :class:`ModelDirError` unless ``path`` is a loadable model directory; return its config.

    ``need_chat_template``: the tokenizer must carry a chat template. ``min_context``: the config's
    ``max_position_embeddings`` must be at least this many tokens (the prompt budget).
    """
    root = Path(path)
    if root.is_file() and root.suffix == ".gguf":
        arch = check_gguf(root)
        raise ModelDirError(root, f"is a GGUF file ({arch}), not a model directory; convert it once with "
                                  f"`rollout model prepare --gguf {root} --out DIR` and name DIR")
    if not root.exists():
        raise ModelDirError(root, "model directory does not exist")
    if not root.is_dir():
        raise ModelDirError(root, "is not a directory (a model directory holds config.json, weights and tokenizer files)")
    config = _read_json(root / "config.json", what="model config")
    _check_architecture(root / "config.json", config)
    _check_weights(root)
    _check_tokenizer(root, need_chat_template=need_chat_template)
    if min_context is not None:
        limit = config.get("max_position_embeddings")
        if not isinstance(limit, int):
            raise ModelDirError(root / "config.json", "has no integer max_position_embeddings (the model's context length)")
        if limit < min_context:
            raise ModelDirError(root / "config.json", f"max_position_embeddings is {limit} tokens, shorter than the "
                                                      f"prompt budget of {min_context} tokens")
    return config


def has_chat_template(path: str | os.PathLike[str]) -> bool:
    """Whether the tokenizer files in directory ``path`` carry a chat template."""
    root = Path(path)
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        return True
    tc = root / "tokenizer_config.json"
    if not tc.is_file():
        return False
    template = _read_json(tc, what="tokenizer config").get("chat_template")
    return bool(template)


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """The ``general.architecture`` of a GGUF file's header (needs the ``gguf`` package)."""
    file = Path(path)
    if not file.is_file():
        raise ModelDirError(file, "GGUF file does not exist")
    import gguf  # only here: the rest of this module must stay importable without it

    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, OSError) as exc:  # bad magic, truncated header, unreadable
        raise ModelDirError(file, f"not a readable GGUF file: {exc}") from None
    field = reader.get_field("general.architecture")
    if field is None:
        raise ModelDirError(file, "GGUF header has no general.architecture")
    return str(field.contents())


def check_gguf(path: str | os.PathLike[str]) -> str:
    """Raise :class:`ModelDirError` unless the GGUF file's architecture is supported; return it."""
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelDirError(path, f"GGUF architecture {arch!r} is not supported (supported: "
                                  f"{', '.join(GGUF_ARCHITECTURES)})")
    return arch


def _read_json(file: Path, *, what: str) -> dict[str, Any]:
    if not file.is_file():
        raise ModelDirError(file, f"{what} is missing")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelDirError(file, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDirError(file, f"{what} is not a JSON object")
    return data


def _check_architecture(file: Path, config: dict[str, Any]) -> None:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelDirError(file, f"names no architectures (model_type {config.get('model_type')!r}); supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ModelDirError(file, f"architecture {', '.join(map(str, unsupported))} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _check_weights(root: Path) -> None:
    if (root / "model.safetensors").is_file():
        return
    index = root / SAFETENSORS_INDEX
    if not index.exists():
        found = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.gguf"))
        hint = f" (found {', '.join(found)}: only safetensors are loaded)" if found else ""
        raise ModelDirError(root, f"no weights: neither model.safetensors nor {SAFETENSORS_INDEX}{hint}")
    weight_map = _read_json(index, what="sharded weights index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelDirError(index, "has no weight_map")
    for shard in sorted(set(map(str, weight_map.values()))):
        if not (root / shard).is_file():
            raise ModelDirError(root / shard, f"weight shard listed in {SAFETENSORS_INDEX} is missing")


def _check_tokenizer(root: Path, *, need_chat_template: bool) -> None:
    if not ((root / "tokenizer.json").is_file() or (root / "tokenizer.model").is_file()
            or ((root / "vocab.json").is_file() and (root / "merges.txt").is_file())):
        raise ModelDirError(root / "tokenizer.json", "tokenizer files are missing (need tokenizer.json, or "
                                                     "tokenizer.model, or vocab.json + merges.txt)")
    if need_chat_template and not has_chat_template(root):
        raise ModelDirError(root / "tokenizer_config.json", "the tokenizer has no chat template (neither "
                                                            "chat_template.jinja nor a chat_template entry), and "
                                                            "prompts are rendered with one")


def check_config_model_dir(cfg: Any, source: str | os.PathLike[str] | None) -> None:
    """Check an engine config's ``inference.model_dir`` (if set) before any role starts.

    Raises :class:`engine.config.ConfigError` naming the config file, the field, the model file and
    what is wrong. The directory must hold a context window of at least ``inference.max_new_tokens``.
    """
    from engine.config import ConfigError

    model_dir = cfg.inference.model_dir
    if not model_dir:
        return
    try:
        check_model_dir(model_dir, min_context=cfg.inference.max_new_tokens)
    except ModelDirError as exc:
        raise ConfigError(f"{source or '<defaults>'}: inference.model_dir: {exc}") from None
