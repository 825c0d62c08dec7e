"""Context-length curriculum: short documents first, longer ones as the model succeeds at each length.

Why: a policy that cannot yet answer about a 1k-token document learns nothing from 8k-token ones (every
sample fails, every group has zero variance) and each of them costs eight times the inference and
training compute. So a steered domain starts at the first of ``lengths`` and moves to the next once its
success rate at the current length reaches ``threshold``, measured over at least ``window`` samples drawn
at that length. It never moves back: a lower success rate after a step is the expected cost of a longer
context, not a sign to retreat.

Same shape as the scheduler's difficulty :class:`actors.scheduler.Curriculum`: ``difficulty(domain)``
and ``observe(domain, count, success)`` with the reward actors' cumulative sample ``count`` and recent
``success`` rate, so the scheduler consults either one the same way. A length is turned into the
domain's ``difficulty`` by ``to_difficulty`` (for ``longdoc``:
:func:`domains.longdoc.difficulty_for_tokens`). Pure logic: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


class LengthCurriculum:
    """Per-domain position in an increasing list of context lengths (tokens)."""

    def __init__(self, domains: Iterable[str], lengths: Sequence[int], *, threshold: float, window: int,
                 to_difficulty: Callable[[int], float]) -> None:
        lengths = [int(n) for n in lengths]
        if not lengths or any(b <= a for a, b in zip(lengths, lengths[1:])):
            raise ValueError(f"length_curriculum.lengths must be a non-empty increasing list, got {lengths}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"length_curriculum.threshold must be in (0, 1], got {threshold}")
        if window < 1:
            raise ValueError(f"length_curriculum.window must be at least 1, got {window}")
        self.lengths = lengths
        self.threshold = threshold
        self.window = window
        self._difficulty = [to_difficulty(n) for n in lengths]  # raises early on a length the domain cannot make
        self._level = {d: 0 for d in domains}
        self._count_at_change: dict[str, int] = {}
        self._samples_at_level = {d: 0 for d in self._level}
        self._last_success: dict[str, float] = {}

    def steers(self, domain: str | None) -> bool:
        """Whether ``domain``'s difficulty comes from this curriculum."""
        return domain in self._level

    def length(self, domain: str) -> int:
        """The context length (tokens) ``domain``'s tasks are drawn at now."""
        return self.lengths[self._level[domain]]

    def difficulty(self, domain: str) -> float:
        """The domain difficulty that draws documents of :meth:`length` tokens."""
        return self._difficulty[self._level[domain]]

    def observe(self, domain: str, count: int, success: float) -> float:
        """Take ``domain``'s cumulative sample count and recent success rate; returns its (possibly new) difficulty.

        The first observation after a step only marks where the new length's samples start; the step to the
        next length needs ``window`` samples past that mark and ``success >= threshold``.
        """
        if domain not in self._level:
            raise KeyError(f"length curriculum does not steer domain {domain!r}")
        since = self._count_at_change.setdefault(domain, count)
        self._samples_at_level[domain] = count - since
        self._last_success[domain] = success
        level = self._level[domain]
        if count - since >= self.window and success >= self.threshold and level + 1 < len(self.lengths):
            self._level[domain] = level + 1
            self._count_at_change[domain] = count
            self._samples_at_level[domain] = 0
        return self.difficulty(domain)

    def state(self) -> dict[str, dict[str, Any]]:
        """Per-domain state for status and metrics: current length, level, samples at it, last success rate."""
        return {d: {"length": self.lengths[lvl], "level": lvl, "levels": len(self.lengths),
                    "samples_at_length": self._samples_at_level[d], "success": self._last_success.get(d)}
                for d, lvl in self._level.items()}
