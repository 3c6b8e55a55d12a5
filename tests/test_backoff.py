"""The one retry policy."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.backoff import Backoff


def test_the_delay_doubles_from_the_first_up_to_the_cap():
    policy = Backoff(first=1.0, cap=30.0)
    assert [policy.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert Backoff(first=0.5, cap=30.0).delay(1) == 0.5


@given(st.integers(1, 10_000), st.floats(0.01, 10), st.floats(0.01, 3600))
def test_a_jittered_wait_is_never_longer_than_the_delay(attempt, first, cap):
    policy = Backoff(first=first, cap=cap)
    assert 0 <= policy.jittered(attempt) <= policy.delay(attempt) <= max(cap, 0)
