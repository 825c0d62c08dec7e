"""Statistics for `rollout eval`: Wilson score intervals, the unbiased pass@k estimator and its interval over tasks.

Why Wilson: held-out sets are small and completion rates near 0 or 1 early and late in training, where
the normal-approximation interval collapses to zero width or leaves [0, 1]. Why the unbiased pass@k
(Chen et al. 2021): ``1 - (1 - c/n)^k`` is biased when k is close to n; the estimator below is not.
"""

from __future__ import annotations

import math


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% at the default ``z``)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k), as a product to stay exact for large n
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def mean_interval(per_task: list[float], z: float = 1.96) -> tuple[float, float]:
    """A 95% interval (at the default ``z``) for the mean of per-task estimates in [0, 1] (pass@k over tasks).

    The Wilson score interval with the tasks as trials and their mean as the proportion. A per-task estimate
    in [0, 1] with mean p has variance at most p(1 - p), the variance of a 0/1 outcome, so the interval is
    exact Wilson when every estimate is 0 or 1 (one sample per task, or pass@k with k = n) and conservative
    otherwise; unlike a normal interval over the estimates it neither collapses to zero width when every task
    scored the same (all 0 early in training) nor leaves [0, 1]. The uncertainty it covers is which tasks
    the benchmark happened to hold (the tasks are a sample), with the generations' own noise inside it.
    """
    if not per_task:
        raise ValueError("need at least one per-task estimate")
    if any(not 0.0 <= x <= 1.0 for x in per_task):
        raise ValueError(f"per-task estimates must lie in [0, 1], got {min(per_task)}..{max(per_task)}")
    n = len(per_task)
    p = sum(per_task) / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))
