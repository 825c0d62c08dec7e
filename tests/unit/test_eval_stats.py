"""Wilson intervals and unbiased pass@k against direct computations."""

from __future__ import annotations

import itertools
import math

import pytest

from engine.eval_stats import pass_at_k, wilson_interval


def test_wilson_known_values_and_bounds() -> None:
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(8, 10)
    assert (lo, hi) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and 0.69 < lo < 0.73
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        wilson_interval(3, 2)


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 4), (4, 1, 4), (7, 5, 2)])
def test_pass_at_k_matches_enumeration(n: int, c: int, k: int) -> None:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert math.isclose(pass_at_k(n, c, 1), c / n)
