"""The one narrow interface between sync/ and a kernel backend.

Owns: `Kernel` (observe / apply), `Plan`, `ApplyReport`, `Failure`. Implementations: the
netlink IPVS backend, the iptables fallback, `saved_table.SavedTable` (a saved ipvsadm table,
read-only: `diff --kernel-state`), and the tests' `ipvsproxy.testing.FakeKernel`.

The agent runs watchers in threads and one sync thread (the `kubernetes` client is
synchronous), so the interface is synchronous too.

Imports: model, errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ipvsproxy.errors import KernelError
from ipvsproxy.model import IpvsState, Op, RSKey, Traffic, VSKey

Plan = tuple[Op, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """One operation the kernel refused."""

    op: Op
    error: KernelError


@dataclass(frozen=True, slots=True)
class ApplyReport:
    """What happened to a plan: every op not listed in `failures` was applied."""

    applied: int = 0
    failures: tuple[Failure, ...] = ()
    # backend transactions refused as a whole (nothing of each written: the fallback's
    # iptables-restore), whether or not they carried operations (a repair alone carries none)
    refused: tuple[KernelError, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures


# Per virtual server, its access: the frontend it is (ClusterIP, NodePort, ...), its traffic
# policy and source ranges (sync.desired's `Access`, read through policy's `AccessLike`).
# What a backend that renders each virtual server's rules itself (the fallback) needs beyond
# the operations; the IPVS table has no place for it, and the IPVS backend ignores it.
AccessMap = Mapping[VSKey, Any]


class Kernel(Protocol):
    """Everything sync/ may ask of a kernel backend."""

    # Whether everything in this backend's table was made by ipvsproxy (the fallback's own
    # chains): its observation is then the record of what ipvsproxy made (ownership rule 5).
    # The IPVS table is shared with whoever else uses IPVS: False.
    owns_table: bool

    def observe(self, *, access: AccessMap | None = None) -> IpvsState:
        """The backend's current table, including objects ipvsproxy does not own. `access`:
        the desired access of the virtual servers, for a backend that compares its rules
        with what they render to (the fallback: a rule missing is damage)."""
        ...

    def apply(
        self,
        plan: Sequence[Op],
        *,
        names: Mapping[VSKey, str] | None = None,
        access: AccessMap | None = None,
    ) -> ApplyReport:
        """Execute ops in order. A per-op KernelError is reported, not raised.

        `names` says which Service port each virtual server stands for ("ns/name:port"); a
        backend that can keep it (iptables: rule comments) does. `access`: that of the
        virtual servers the pass looked at; a backend that renders it rewrites those whose
        access changed, with or without an operation. Raises KernelUnavailable only when
        the backend cannot be used at all.
        """
        ...

    def damage(self) -> tuple[str, ...]:
        """What the last observe() found wrong in the backend's own objects that the state
        cannot express (iptables: a rule deleted or added in an ipvsproxy chain), in words.

        Any apply(), even of an empty plan, repairs it; () when there is nothing to repair.
        """
        ...

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        """(active, inactive) connections per destination of one virtual server.

        Used to drain removed endpoints; a backend without such counters returns {} (every
        destination then counts as idle). Raises KernelError (NotFound for no such service).
        """
        ...

    def traffic(self) -> Mapping[VSKey, Traffic]:
        """Counters of every virtual server and its destinations, read when asked (`status`,
        the per-Service metrics), never on the sync path. A backend without counters (the
        iptables fallback) returns {}."""
        ...
