"""Atomic learner checkpoints on a local (or shared) file system.

Layout under ``<checkpoint_dir>/<namespace>/``::

    step-00000010-v000010/      one checkpoint: the state after optimizer step 10, learner version 10
        model/                  save_pretrained: config.json, model.safetensors, tokenizer files
        optimizer.pt            AdamW state (torch.save)
        state.json              Learner.progress(): step, version, offsets, ledger, seen ids
    .tmp-...                    a checkpoint being written (ignored, removed on the next start)

A checkpoint is written into a ``.tmp-*`` directory, every file fsynced, then renamed into place in
one ``os.rename``: a reader sees a whole checkpoint or none. The newest is the largest
(step, version); a resumed learner may republish its weights under a higher version at the same step
(see ``docs/learner.md``), hence the version in the name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from modelserver.llm import load_model_dir, save_model_dir

log = logging.getLogger("rollout.learner")

_NAME = re.compile(r"^step-(\d{8,})-v(\d{6,})$")


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint."""

    path: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: dict[str, Any]
    progress: dict[str, Any]


class CheckpointStore:
    """Writes and finds checkpoints in one directory; keeps the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                found.append(((int(m[1]), int(m[2])), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        ckpts = self.list()
        return ckpts[-1] if ckpts else None

    def remove_partial(self) -> None:
        """Delete ``.tmp-*`` leftovers of a crash mid-write (only this store's directory)."""
        if self.root.is_dir():
            for p in self.root.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)

    def save(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, optimizer: dict[str, Any],
             progress: dict[str, Any]) -> Path:
        """Write one checkpoint atomically; returns its path (unchanged if that state is already saved)."""
        final = self.root / f"step-{progress['step']:08d}-v{progress['version']:06d}"
        if final.exists():
            return final  # same step and version: the same state, already durable
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            save_model_dir(model, tokenizer, tmp / "model")
            torch.save(optimizer, tmp / "optimizer.pt")
            (tmp / "state.json").write_text(json.dumps(progress, sort_keys=True))
            _fsync_tree(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.list()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: str | Path) -> Checkpoint:
        path = Path(path)
        model, tokenizer = load_model_dir(path / "model")
        optimizer = torch.load(path / "optimizer.pt", weights_only=True)
        progress = json.loads((path / "state.json").read_text())
        return Checkpoint(path, model, tokenizer, optimizer, progress)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
