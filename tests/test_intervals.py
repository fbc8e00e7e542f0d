"""The confidence intervals the library reports (sigmafast/intervals.py) against published values."""

from __future__ import annotations

import math

import pytest

from sigmafast.intervals import t_central, t_quantile, wilson_interval


def test_wilson_interval_known_values():
    """Newcombe 1998, table I: 81/263 -> [0.2553, 0.3662]; 0/10 -> [0, 0.2775]."""
    low, high = wilson_interval(81, 263)
    assert abs(low - 0.2553) < 5e-5 and abs(high - 0.3662) < 5e-5
    assert wilson_interval(0, 10)[0] == 0.0 and abs(wilson_interval(0, 10)[1] - 0.2775) < 5e-5
    with pytest.raises(ValueError, match="need 0 <= successes <= n"):
        wilson_interval(3, 2)


@pytest.mark.parametrize("df,want", [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (5, 2.570582),
                                     (9, 2.262157), (10, 2.228139), (29, 2.045230), (49, 2.009575),
                                     (1000, 1.962339), (1001, 1.962337), (100_000, 1.959988)])
def test_t_quantile_matches_the_tables(df, want):
    """Two-sided 95% quantiles of Student's t (the standard tables, six decimals)."""
    assert t_quantile(0.95, df) == pytest.approx(want, abs=2e-6)


def test_t_central_is_the_cauchy_law_at_one_degree_and_tends_to_the_normal():
    for t in (0.3, 1.0, 4.0):
        assert t_central(t, 1) == pytest.approx(2 * math.atan(t) / math.pi, abs=1e-15)
        assert t_central(t, 2) == pytest.approx(t / math.sqrt(2 + t * t), abs=1e-15)  # the closed form at df = 2
    assert t_central(1.959963984540054, 100_000) == pytest.approx(0.95, abs=1e-5)


@pytest.mark.parametrize("level,df", [(0.95, 0), (0.95, 2.0), (0.95, True), (1.0, 5), (0.0, 5)])
def test_t_quantile_bad_input(level, df):
    with pytest.raises(ValueError):
        t_quantile(level, df)


def test_the_training_log_gives_proportions_of_sequences_with_their_interval_and_count():
    from sigmafast.evaluation import metrics_line

    line = metrics_line({"valid": 0.625, "ones_rate": 0.5}, 16)
    low, high = wilson_interval(10, 16)
    assert line == f"valid 0.625 [{low:.3f}, {high:.3f}] of 16 ones_rate 0.500"
    assert line.startswith("valid 0.625 [0.386, 0.815] of 16")
