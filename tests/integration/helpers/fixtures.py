"""Messages and host scans shared by the integration tests."""

from __future__ import annotations

import os

import numpy as np

from engine.schemas import Completion, Outcome
from sandboxes.bwrap import UID_BASE, UID_COUNT


def answer_outcome(task_id: str, index: int, correct: bool, group_size: int) -> Outcome:
    """The answer verifier's outcome for sample ``index`` of an arith task whose answer is 19."""
    n = 3
    completion = Completion(
        sample_id=f"{task_id}/{index}", task_id=task_id, domain="arith", group_index=index, group_size=group_size,
        prompt_ids=np.arange(4, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
        logprobs=np.full(n, -0.5, np.float32), loss_mask=np.ones(n, np.uint8),
        weight_versions=np.zeros(n, np.int32), text="19" if correct else "18", finish_reason="stop",
        spec={"answer": "19"})
    return Outcome(completion=completion.to_body(), facts={"correct": correct, "extracted": completion.text},
                   verifier="answer")


def sandbox_processes() -> set[int]:
    """Live processes running as a sandbox uid."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            if UID_BASE <= uid < UID_BASE + UID_COUNT:
                found.add(int(entry))
    return found


def process_state(pid: int | str) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``R``, ``S``, ``Z``, ...); empty once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
