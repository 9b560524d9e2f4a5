"""The 95% intervals the benchmarks print beside paired ratios (``median_interval`` in
``fa_sm100.benchmarking``): exact order statistics, coverage, and the verdict per cell."""

import math
import random

import pytest

from fa_sm100.benchmarking import (format_interval, interval_verdict, median_interval,
                                   paired_interval, verdict_summary)


def coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n draws of a continuous distribution."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n


@pytest.mark.parametrize("n,k", [(6, 1), (8, 1), (9, 2), (12, 3), (20, 6), (24, 7), (30, 10)])
def test_the_interval_is_the_widest_order_statistics_that_reach_95_percent(n, k):
    values = [10.0 * i for i in range(n, 0, -1)]  # any order: the function sorts
    assert median_interval(values) == (10.0 * k, 10.0 * (n + 1 - k))
    assert coverage(n, k) >= 0.95 > coverage(n, k + 1)


@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_fewer_than_six_rounds_give_no_95_percent_interval(n):
    assert median_interval([1.0] * n) is None


def test_a_lower_confidence_needs_fewer_rounds():
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0], confidence=0.9) == (1.0, 5.0)  # 93.75%
    assert median_interval([3.0, 1.0, 2.0, 5.0], confidence=0.9) is None  # 87.5%


def test_the_interval_covers_the_median_of_a_skewed_distribution_95_percent_of_the_time():
    """Lognormal draws (median 1.0; timing noise is skewed the same way): over 3000 samples
    of 12 and of 20 values the interval holds 1.0 at least as often as the exact coverage
    promises, within three standard errors."""
    rng = random.Random(33)
    for n in (12, 20):
        held = 0
        for _ in range(3000):
            lo, hi = median_interval([math.exp(rng.gauss(0.0, 0.01)) for _ in range(n)])
            held += lo <= 1.0 <= hi
        k = {12: 3, 20: 6}[n]
        expected = coverage(n, k)
        assert held / 3000 >= expected - 3 * math.sqrt(expected * (1 - expected) / 3000)


def test_a_bad_confidence_is_refused():
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0] * 10, confidence=1.0)


def test_paired_interval_pairs_each_round_with_the_fastest_peer():
    # ours over the fastest peer by round: 1.1, 0.9, 1.0, 1.05, 0.95, 1.02
    ours = [1.0] * 6
    times = {"ours": ours, "fa4": [1.1, 0.9, 1.0, 1.2, 0.95, 1.02],
             "cudnn": [1.3, 1.3, 1.3, 1.05, 1.3, 1.3]}
    assert paired_interval(times, "ours", ["fa4", "cudnn"]) == pytest.approx((0.9, 1.1))
    assert paired_interval({"ours": ours, "fa4": []}, "ours", ["fa4"]) is None


def test_verdicts_say_whether_one_lies_inside_the_interval():
    assert interval_verdict((1.001, 1.02)) == "above"
    assert interval_verdict((0.97, 0.999)) == "below"
    assert interval_verdict((0.99, 1.01)) == "parity"
    assert interval_verdict((1.0, 1.01)) == "parity"  # 1.00 itself is inside
    assert interval_verdict(None) == "too few rounds"
    line = verdict_summary([(1.01, 1.02), (1.02, 1.05), (0.99, 1.01), None, (0.9, 0.95)])
    assert line == ("paired 95% intervals: 2 cells above 1.00, 1 cell at parity (1.00 inside), "
                    "1 cell below 1.00, 1 cell with too few rounds for an interval")
    assert format_interval(None) == "[n/a]"
    assert format_interval((0.99949, 1.0121)) == "[0.999, 1.012]"
