"""Statistics of an evaluation: success rate with a Wilson score interval, turns, invalid actions.

The Wilson interval (not the normal "Wald" one) because panels are small and success rates are
often near 0 or 1, where p +- z*sqrt(p(1-p)/n) collapses to a zero-width interval.
"""

from __future__ import annotations

import math
from statistics import NormalDist


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion `successes / n`.

        center = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

    with z the two-sided normal quantile for `confidence`. n = 0 says nothing: (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n < 0 or successes < 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At p = 0 (p = 1) the lower (upper) bound is exactly 0 (1); say so instead of 2.8e-17.
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == n else min(1.0, center + half)
    return (lo, hi)


def summarize_episodes(
    won: list[bool], turns: list[int], invalid: list[int], confidence: float = 0.95
) -> dict:
    """One policy's metrics on a panel: one entry per task in each list.

    invalid_rate is invalid actions over all turns played (0 when no turn was played)."""
    if not len(won) == len(turns) == len(invalid):
        raise ValueError(
            f"won, turns and invalid must have one entry per task, got {len(won)}, {len(turns)}, {len(invalid)}"
        )
    n = len(won)
    k = sum(bool(w) for w in won)
    lo, hi = wilson_interval(k, n, confidence)
    total_turns = sum(turns)
    return {
        "success": k / n if n else 0.0,
        "ci_low": lo,
        "ci_high": hi,
        "n_tasks": n,
        "mean_turns": total_turns / n if n else 0.0,
        "invalid_rate": sum(invalid) / total_turns if total_turns else 0.0,
    }


def _bootstrap_indices(rng, shape: tuple[int, int], n_boot: int):
    """Resample rows (seeds) and columns (tasks) with replacement: a two-level bootstrap, so both
    the tasks' and the training seeds' variability widen the interval."""
    s, t = shape
    return rng.integers(0, s, size=(n_boot, s)), rng.integers(0, t, size=(n_boot, t))


def bootstrap_mean(outcomes, confidence: float = 0.95, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of per-(seed, task) outcomes [S, T] (or [T]): percentile bootstrap over seeds and tasks."""
    import numpy as np

    x = np.atleast_2d(np.asarray(outcomes, dtype=float))
    if x.size == 0:
        raise ValueError("bootstrap_mean needs at least one outcome")
    rng = np.random.default_rng(seed)
    rows, cols = _bootstrap_indices(rng, x.shape, n_boot)
    means = np.array([x[r][:, c].mean() for r, c in zip(rows, cols)])
    a = (1 - confidence) / 2
    return float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def paired_difference(a, b, confidence: float = 0.95, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean(a - b), low, high) for two policies' outcomes on the same cells [S, T] (same seeds,
    same tasks): the pairing removes the variance the two share (task difficulty)."""
    import numpy as np

    a, b = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
    if a.shape != b.shape:
        raise ValueError(f"paired_difference needs outcomes on the same cells, got shapes {a.shape} and {b.shape}")
    return bootstrap_mean(a - b, confidence, n_boot, seed)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c succeeded (Chen et al., 2021):

        pass@k = 1 - C(n - c, k) / C(n, k)

    computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the large binomials.
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n (k samples drawn from n), got k={k}, n={n}")
    if n - c < k:  # every draw of k contains a success
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def compare_paired(a, b, confidence: float = 0.95, n_boot: int = 2000, seed: int = 0) -> dict:
    """Policy a vs policy b on the same panel (per-task outcomes in the same order, or [seeds, tasks]):
    the mean difference a - b with a paired bootstrap CI over tasks. `significant` when the CI
    excludes 0; `better` names the policy the CI favours ("a", "b" or None)."""
    diff, lo, hi = paired_difference(a, b, confidence, n_boot, seed)
    better = "a" if lo > 0 else "b" if hi < 0 else None
    return {"diff": diff, "ci_low": lo, "ci_high": hi, "significant": better is not None, "better": better,
            "confidence": confidence}
