"""Model and tokenizer construction shared by the learner and the local inference backend.

Everything here is built locally and deterministically (nothing is downloaded):

- :func:`build_char_tokenizer` makes a character-level ``PreTrainedTokenizerFast`` whose vocabulary is
  four special tokens (``<pad>`` ``<s>`` ``</s>`` ``<unk>``, ids 0-3) followed by printable ASCII, newline
  and tab, enough for digits, arithmetic, Python code and shell text. Encoding adds no special tokens, so
  ``decode(encode(text)) == text`` for any text in the character set (token-in-token-out is exact).
- :func:`tiny_config` / :func:`build_tiny_model` make a small Llama-architecture causal LM; the learner
  trains and the inference server serves the same Hugging Face class.
- :func:`save_model_dir` / :func:`load_model_dir` use the Hugging Face layout: ``config.json``,
  ``model.safetensors`` (or sharded, with ``model.safetensors.index.json``), ``tokenizer.json`` and
  ``tokenizer_config.json``. :func:`load_model_dir` loads any local Llama / Qwen2 / Mistral directory
  (a real model prepared by modelserver/prepare.py too) with the tokenizer class the directory names,
  after :func:`modelserver.model_dir.check_model_dir` has checked it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from modelserver.model_dir import ModelDirError, check_model_dir

log = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARSET: tuple[str, ...] = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")

__all__ = [
    "CHARSET",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_model",
    "load_model_dir",
    "model_construction",
    "save_model_dir",
    "tiny_config",
    "write_tiny_model_dir",
]


_CONSTRUCTION = threading.RLock()
_TIE_WEIGHTS = PreTrainedModel.tie_weights


@contextmanager
def model_construction() -> Iterator[None]:
    """Hold while building or loading a model: one at a time in this process, weight tying intact.

    transformers 5 turns weight tying off during ``from_pretrained`` by replacing ``PreTrainedModel.tie_weights``
    on the class and putting back, afterwards, whatever it found there. Two loads in two threads (the local
    server's and the learner's, in one process) interleave: the second finds the first's no-op and puts that
    back, and from then on every load in the process leaves a tied ``lm_head`` as uninitialised memory (NaN or
    uniform logits, SmolLM2 included). Every load in this package holds this lock; a load elsewhere that broke
    the class is repaired here, with a warning.
    """
    with _CONSTRUCTION:
        if PreTrainedModel.tie_weights is not _TIE_WEIGHTS:
            log.warning("PreTrainedModel.tie_weights was left replaced (a concurrent from_pretrained outside "
                        "modelserver.llm.model_construction); restoring it")
            PreTrainedModel.tie_weights = _TIE_WEIGHTS  # type: ignore[method-assign]
        yield


def check_tied(model: PreTrainedModel, where: str | os.PathLike[str]) -> None:
    """Raise :class:`ModelDirError` if ``model``'s config ties its output head to its embedding but the two are
    different tensors (a load that did not tie: the head would be uninitialised memory)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head = getattr(model.get_output_embeddings(), "weight", None)
    embed = getattr(model.get_input_embeddings(), "weight", None)
    if isinstance(head, torch.Tensor) and isinstance(embed, torch.Tensor) and head.data_ptr() != embed.data_ptr():
        raise ModelDirError(where, "the config ties the output head to the embedding, but the loaded model "
                                   "holds them apart (weight tying was off while it loaded)")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Return the character-level tokenizer (deterministic: the vocabulary is fixed, no training)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARSET)}
    # A BPE model with no merges splits a string into single characters, and with no pre-tokenizer the
    # spaces stay ordinary characters; Fuse joins decoded tokens without inserting spaces.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=1 << 30,
    )


def tiny_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.1,
    attn_implementation: str = "sdpa",
) -> LlamaConfig:
    """A small Llama config; ids of the special tokens follow :func:`build_char_tokenizer`.

    ``initializer_range`` is larger than Llama's 0.02 so that an untrained model's next-token
    distributions are not nearly flat: greedy decoding then has clear winners, and batched vs
    sequential decoding agree despite float rounding.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    return config


def build_tiny_model(config: LlamaConfig, *, seed: int = 0) -> PreTrainedModel:
    """Build a randomly initialised causal LM from ``config``; the same seed gives the same weights.

    The global torch RNG is left as it was (initialisation runs inside ``torch.random.fork_rng``).
    """
    with model_construction(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=config._attn_implementation or "sdpa", dtype=torch.float32
        )
    check_tied(model, "build_tiny_model")
    model.eval()
    return model


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` and ``tokenizer`` to ``path`` in Hugging Face layout and return the path."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def load_model_dir(
    path: str | os.PathLike[str], *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model directory written by :func:`save_model_dir` (or any local HF causal-LM directory).

    Raises :class:`modelserver.model_dir.ModelDirError` (naming the file) for a directory that cannot load.
    """
    check_model_dir(path)
    with model_construction():
        model = AutoModelForCausalLM.from_pretrained(
            str(path), attn_implementation=attn_implementation, dtype=dtype, local_files_only=True
        )
    check_tied(model, path)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tokenizer


def write_tiny_model_dir(path: str | os.PathLike[str], *, seed: int = 0, **config_overrides: object) -> Path:
    """Build the char tokenizer and a tiny model (``tiny_config`` keyword overrides) and save both to ``path``."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tokenizer), **config_overrides), seed=seed)  # type: ignore[arg-type]
    return save_model_dir(model, tokenizer, path)


# -- prompts -----------------------------------------------------------------------------------------

def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer carries a chat template (an instruct model's; the char fixture has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, *, system: str | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``prompt`` as the model expects it: the chat template's user turn (after ``system``, when
    given; else the template's default) and the assistant header, or the raw text for a model without one.

    The text is rendered first and encoded once with ``add_special_tokens=False`` (the template writes its
    own special tokens), so the ids are exactly those the learner later scores.
    """
    if not has_chat_template(tokenizer):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}]
    if tools:  # declared tools (JSON schemas): the template's tool support, else a Hermes block (engine.tools)
        from engine.tools import render_tool_messages
        text = render_tool_messages(tokenizer, messages, tools)
    else:
        text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_observation(tokenizer: PreTrainedTokenizerBase, observation: str | list[dict[str, Any]], *,
                       ended_turn: bool, role: str = "user") -> list[int]:
    """Token ids that close the model's turn and hand it ``observation`` as the next turn(s), ending at the
    assistant header (multi-turn episodes of a chat model).

    ``observation``: a text, handed back as one turn of ``role`` (``"user"``: a shell episode's output), or a
    list of chat messages (a ``tools`` episode's step: ``{"role": "tool", "name", "content"}`` per call, or a
    ``user`` hint), rendered together by the template as those turns (a template that groups consecutive tool
    results into one turn, as Qwen's does, groups them), whole.
    ``ended_turn``: the model's last token already ended its turn (it stopped on the end-of-turn token), so
    only what the template writes after that token follows.
    """
    from engine.tools import apply_chat_template

    messages = [{"role": role, "content": observation}] if isinstance(observation, str) else list(observation)
    base = [{"role": "system", "content": "s"}]
    before = apply_chat_template(tokenizer, base + [{"role": "assistant", "content": "\x00"}])
    closing = before.split("\x00", 1)[1]  # what the template writes after an assistant message
    eos = tokenizer.eos_token or ""
    if ended_turn and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    start = apply_chat_template(tokenizer, base)
    turn = apply_chat_template(tokenizer, base + messages, add_generation_prompt=True)
    if not turn.startswith(start):
        raise ValueError("the chat template renders a conversation's prefix differently once a turn is added")
    return list(tokenizer.encode(closing + turn[len(start):], add_special_tokens=False))
