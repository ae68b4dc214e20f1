"""Wilson interval against values worked by hand, and the episode summary."""

import math

import pytest

from agentkiln.stats import summarize_episodes, wilson_interval

# z for 95 %: 1.959964, z^2 = 3.841459.


def test_textbook_81_of_263():
    # p = 81/263 = 0.307985; z^2/n = 0.014606; denominator 1 + z^2/n = 1.014606
    # center = (0.307985 + 0.007303) / 1.014606 = 0.310744
    # half = 1.959964 / 1.014606 * sqrt(0.307985 * 0.692015 / 263 + 3.841459 / (4 * 263^2))
    #      = 1.931749 * sqrt(0.00081037 + 0.00001388) = 1.931749 * 0.028710 = 0.055461
    # -> (0.2553, 0.3662)  (the classic example in Wilson-interval write-ups)
    lo, hi = wilson_interval(81, 263)
    assert lo == pytest.approx(0.2553, abs=1e-4)
    assert hi == pytest.approx(0.3662, abs=1e-4)


def test_half_of_ten_is_symmetric():
    # p = 0.5: center = (0.5 + 0.192073) / 1.384146 = 0.5
    # half = 1.959964 / 1.384146 * sqrt(0.025 + 0.0096037) = 1.416007 * 0.186020 = 0.263408
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.236593, abs=1e-5)
    assert hi == pytest.approx(0.763407, abs=1e-5)
    assert lo + hi == pytest.approx(1.0)


def test_zero_of_ten():
    # p = 0: lower bound is 0; upper = (z^2/n) / (1 + z^2/n) = 0.384146 / 1.384146 = 0.277533
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0
    assert hi == pytest.approx(0.277533, abs=1e-5)


def test_ten_of_ten_mirrors_zero_of_ten():
    # p = 1: upper bound is 1; lower = 1 / (1 + z^2/n) = 1 / 1.384146 = 0.722467
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0
    assert lo == pytest.approx(0.722467, abs=1e-5)


def test_no_tasks_says_nothing():
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_higher_confidence_is_wider():
    lo95, hi95 = wilson_interval(81, 263, 0.95)
    lo99, hi99 = wilson_interval(81, 263, 0.99)
    assert lo99 < lo95 and hi99 > hi95
    # z for 99 % = 2.575829: the half-width grows by about 2.575829 / 1.959964 = 1.314
    assert (hi99 - lo99) / (hi95 - lo95) == pytest.approx(1.31, abs=0.01)


@pytest.mark.parametrize("k,n,conf", [(-1, 10, 0.95), (11, 10, 0.95), (1, 10, 1.0), (1, 10, 0.0)])
def test_rejects_impossible_input(k, n, conf):
    with pytest.raises(ValueError):
        wilson_interval(k, n, conf)


def test_interval_contains_the_estimate():
    for n in (1, 2, 7, 50):
        for k in range(n + 1):
            lo, hi = wilson_interval(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_summarize_episodes():
    # 2 of 4 won; 3 + 5 + 10 + 2 = 20 turns, 1 + 0 + 4 + 0 = 5 invalid -> 0.25
    m = summarize_episodes([True, False, False, True], [3, 5, 10, 2], [1, 0, 4, 0], 0.95)
    assert set(m) == {"success", "ci_low", "ci_high", "n_tasks", "mean_turns", "invalid_rate"}
    assert m["success"] == 0.5
    assert m["n_tasks"] == 4
    assert m["mean_turns"] == 5.0
    assert m["invalid_rate"] == 0.25
    assert (m["ci_low"], m["ci_high"]) == wilson_interval(2, 4, 0.95)


def test_summarize_empty_and_mismatched():
    m = summarize_episodes([], [], [], 0.95)
    assert m["success"] == 0.0 and m["n_tasks"] == 0 and (m["ci_low"], m["ci_high"]) == (0.0, 1.0)
    assert m["invalid_rate"] == 0.0 and not math.isnan(m["mean_turns"])
    with pytest.raises(ValueError, match="one entry per task"):
        summarize_episodes([True], [1, 2], [0], 0.95)


def test_bootstrap_mean_and_paired_difference():
    import numpy as np

    from agentkiln.stats import bootstrap_mean, paired_difference

    rng = np.random.default_rng(0)
    a = (rng.random((3, 200)) < 0.6).astype(float)
    m, lo, hi = bootstrap_mean(a)
    assert m == a.mean() and lo < m < hi and hi - lo < 0.2
    assert bootstrap_mean(np.ones((2, 5))) == (1.0, 1.0, 1.0)
    # a known-better policy: flagged (interval above 0); a policy against itself: exactly 0
    b = np.where(rng.random((3, 200)) < 0.5, 1.0, a)  # a's successes plus more
    d, dlo, dhi = paired_difference(b, a)
    assert d > 0 and dlo > 0
    assert paired_difference(a, a) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same cells"):
        paired_difference(a, a[:, :10])
