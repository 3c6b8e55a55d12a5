"""bench/schedulers.py's figures: what its tables say must mean what their headers say."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from bench.schedulers import kept, percentile, spread


def test_spread_counts_an_endpoint_that_got_nothing():
    assert spread(Counter(a=3), ["a", "b", "c"]) == 3.0  # all on one of three: the hot spot
    assert spread(Counter(a=2, b=2, c=2), ["a", "b", "c"]) == 1.0
    assert spread(Counter(), ["a", "b"]) == 0.0


@given(st.lists(st.floats(min_value=0, max_value=1e3), min_size=1, max_size=200))
def test_percentile_is_a_nearest_rank_value(values):
    assert percentile(values, 100) == max(values)
    assert percentile(values, 1) >= min(values)
    p50, p99 = percentile(values, 50), percentile(values, 99)
    assert p50 in values
    assert p50 <= p99
    assert sum(v <= p99 for v in values) >= 0.99 * len(values)


def test_percentile_of_a_hundred_is_the_ninety_ninth():
    assert percentile([float(v) for v in range(1, 101)], 99) == 99.0


def test_kept_is_over_every_client_before_and_a_refused_one_did_not_keep():
    before = {"s1": "a", "s2": "b", "s3": "c", "s4": "a"}
    assert kept(before, {"s1": "a", "s2": "c", "s4": "a"}) == 0.5  # s3 refused: not kept
    assert kept({}, {}) == 0.0
