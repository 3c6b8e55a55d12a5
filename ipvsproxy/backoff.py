"""The one retry policy: exponential backoff, doubling from a first delay up to a cap.

Owns `Backoff`. Every retry in ipvsproxy waits by it: a virtual server the kernel refused
(sync/failures.py, tried again 1, 2, 4 ... s later, at most a sync period), a pass or a
firewall step that failed (the agent's loop, the same), and a watch that failed (kube.py,
0.5, 1, 2 ... s, at most 30 s, with full jitter as client-go's reflector: many agents
restarting together do not all hit the API server at once).

Imports: the standard library.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    first: float  # seconds before the first retry
    cap: float  # seconds, the longest wait

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th failure in a row (1 for the first)."""
        # the exponent bounded: a node failing for days counts 10,000s of attempts, and a
        # float's exponent ends near 2 ** 1024
        return min(self.first * 2.0 ** min(max(attempt - 1, 0), 64), self.cap)

    def jittered(self, attempt: int) -> float:
        """`delay()` with full jitter: a random wait up to it."""
        return random.uniform(0, self.delay(attempt))
