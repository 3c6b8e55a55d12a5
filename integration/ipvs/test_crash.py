"""Crash safety in CI: two rounds of bench/crash.py (kill -9 during a first sync and during a
large change, restart; the table converges, the foreign virtual server untouched, `diff` in
sync). How fast it converges is bench/crash.py's verdict, not this test's: a busy CI machine
slows the restarted agent more than the clean first sync it is compared with. The 20-round run
at 1000 x 10: bench/crash.py. Run by scripts/vm-test inside the IPVS VM."""

from __future__ import annotations

import random

import pytest

from bench.crash import crash_rounds

pytestmark = pytest.mark.vm


def test_kill_9_at_random_moments_then_restart_converges() -> None:
    seed = random.SystemRandom().randrange(1 << 30)
    rounds = crash_rounds(services=100, dests=10, points=2, seed=seed)
    failed = [r.line() for r in rounds if r.problem]
    again = f"bench/crash.py --seed {seed} --services 100 --points 2"
    assert not failed, f"{again}: {failed}"
    assert len(rounds) == 2
