"""Whether the node still follows the API (ipvsproxy.following): a quiet API is not an unread
one; a failing resource is counted from its last read (the first full pass at the earliest)
and said once per outage past the bound."""

from __future__ import annotations

from ipvsproxy.following import Following, Unread


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(bound: float = 60.0) -> tuple[Following, Clock, list[Unread], list[tuple[str, float]]]:
    clock = Clock()
    stale: list[Unread] = []
    recovered: list[tuple[str, float]] = []
    following = Following(
        bound=bound,
        clock=clock,
        on_stale=stale.append,
        on_recovered=lambda kind, seconds: recovered.append((kind, seconds)),
    )
    return following, clock, stale, recovered


def test_a_quiet_api_is_followed_however_long_nothing_changes():
    following, clock, stale, _ = make()
    following.read("Service")
    following.served()
    clock.now += 3600
    following.check()
    assert following.unread() is None
    assert stale == []


def test_a_failing_resource_is_counted_from_its_first_failure_and_said_once_past_the_bound():
    following, clock, stale, recovered = make()
    following.read("Service")
    following.served()
    clock.now += 50  # a quiet, open watch: following all along
    following.failed("Service", "401 Unauthorized")
    clock.now += 20
    following.failed("Service", "401 Unauthorized")  # still failing: counted from the first
    unread = following.unread()
    assert unread == Unread("Service", 20.0, 1000.0, "401 Unauthorized", False)
    clock.now += 41
    following.failed("Service", "401 Unauthorized")
    following.check()
    assert [(u.kind, u.seconds, u.stale) for u in stale] == [("Service", 61.0, True)]
    clock.now += 9
    following.read("Service")
    assert recovered == [("Service", 70.0)]
    assert following.unread() is None
    # a second outage is said again
    following.failed("Service", "connection refused")
    clock.now += 61
    following.check()
    assert [u.error for u in stale] == ["401 Unauthorized", "connection refused"]


def test_a_silent_watch_timed_out_and_opened_again_at_once_was_never_unread():
    """A watch that receives nothing for longer than the bound (no change, no bookmark) times
    out and is opened again: seen on the multi-node lab as "Nodes not read for 120s" and a
    /readyz 503 for the 0.6 s between the two."""
    following, clock, stale, _ = make()
    following.read("Node")
    following.served()
    clock.now += 120
    following.failed("Node", "Read timed out.")
    unread = following.unread()
    assert unread is not None
    assert not unread.stale
    clock.now += 0.6
    following.read("Node")
    assert stale == []
    assert following.unread() is None


def test_the_bound_counts_from_the_first_full_pass_and_nothing_is_stale_before_it():
    following, clock, stale, _ = make()
    following.read("EndpointSlice")
    clock.now += 500  # a long first pass (a large cluster under emulation)
    following.failed("EndpointSlice", "timed out")
    unread = following.unread()
    assert unread is not None
    assert not unread.stale  # not served yet: /readyz already says why
    following.served()
    clock.now += 30
    assert following.unread() == Unread("EndpointSlice", 30.0, 1000.0, "timed out", False)
    clock.now += 31
    following.check()
    assert [u.kind for u in stale] == ["EndpointSlice"]


def test_each_stale_resource_is_said_and_the_longest_unread_is_reported():
    following, clock, stale, recovered = make(bound=10)
    for kind in ("Service", "EndpointSlice", "Node"):
        following.read(kind)
    following.served()
    following.failed("Node", "403 Forbidden")
    clock.now += 5
    following.read("Node")
    assert recovered == []  # never said stale: its recovery is not said either
    following.failed("Service", "x")
    clock.now += 5
    following.failed("EndpointSlice", "y")
    clock.now += 6
    following.check()
    assert [u.kind for u in stale] == ["Service"]  # failing 11 s; EndpointSlice 6 s
    clock.now += 5
    following.check()
    assert sorted(u.kind for u in stale) == ["EndpointSlice", "Service"]
    worst = following.unread()
    assert worst is not None
    assert (worst.kind, worst.seconds) == ("Service", 16.0)


def test_staleness_a_reader_sees_is_said_before_the_next_failed_attempt():
    """/readyz turns 503 the moment the bound passes, while the watcher may sit in its retry
    back-off: the warning must not come later than the 503 (seen so in CI)."""
    following, clock, stale, _ = make(bound=10)
    following.read("Node")
    following.served()
    following.failed("Node", "401 Unauthorized")
    clock.now += 11  # no further attempt: the watcher backs off
    unread = following.unread()
    assert unread is not None
    assert unread.stale
    assert [u.kind for u in stale] == ["Node"]
    following.unread()
    assert len(stale) == 1  # said once
