"""The companion part of a sync pass: after IPVS, bring the sets and rules in line and
forget the UDP conntrack entries of removed endpoints.

Owns: `after_sync()` (a full pass: observe, plan, apply; with an index, seed it),
`after_partial_sync()` (between full passes: only the changed virtual servers' entries, one
`ipset restore`, no observation, the rules untouched) and `CompanionResult`. Runs with the
IPVS backend only (the iptables fallback masquerades in its own chains).

Imports: companion.*, sync (its results and desired state), model, errors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ipvsproxy.api import NodeView
from ipvsproxy.companion.conntrack import forget_udp, udp_gone
from ipvsproxy.companion.index import SetIndex
from ipvsproxy.companion.ipset import host_after
from ipvsproxy.companion.kernel import Companion, plan_companion
from ipvsproxy.companion.rules import Options
from ipvsproxy.companion.sets import SetState, wanted
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.model import IpvsState, VSKey
from ipvsproxy.policy import node_policy
from ipvsproxy.sync.desired import Desired
from ipvsproxy.sync.engine import SyncResult


@dataclass(frozen=True, slots=True)
class CompanionResult:
    changes: int = 0  # ipset entries and chains written
    error: str = ""  # why the companion part failed ("" = it did not)
    forgotten: int = 0  # conntrack deletions asked for


def options_for(config: Config, node: NodeView) -> Options:
    """The rules' options: the node's policy (the flags, for NodeCIDR its pod CIDRs)."""
    return node_policy(config, tuple(node.pod_cidrs))


def wanted_of(state: IpvsState, desired: Desired) -> SetState:
    """The sets for a synced state: each virtual server's access, this node's endpoints."""
    return wanted(state, desired.access, local=desired.local_endpoints)


def after_sync(
    companion: Companion,
    result: SyncResult,
    desired: Desired,
    options: Options,
    *,
    index: SetIndex | None = None,
) -> CompanionResult:
    """Make the host's companion sets and rules match what the sync asked of IPVS (a full
    pass: observes the host). With `index`, it is rebuilt from the synced state and seeded
    with what the host holds afterwards, for the `after_partial_sync()`s that follow."""
    changes, error = 0, ""
    companion.options = options
    try:
        if index is None:
            sets = wanted_of(result.state, desired)
        else:
            index.reset(result.state, desired.access, local=desired.local_endpoints)
            sets = index.wanted()
        observed = companion.observe()
        plan = plan_companion(sets, observed, options, companion.versions)
        if plan:
            companion.apply(plan)
            changes = len(plan.describe())
        if index is not None:
            index.seed(host_after(observed.sets, plan.sets))
    except KernelError as exc:
        error = str(exc)
    return CompanionResult(changes, error, _forget(companion, result))


def after_partial_sync(
    companion: Companion,
    result: SyncResult,
    desired: Desired,
    index: SetIndex,
    keys: Iterable[VSKey],
) -> CompanionResult:
    """Between full passes: `keys` (the virtual servers the sync touched, and those whose
    endpoints moved to or from this node) re-read from the synced state, their set changes
    written with one `ipset restore`; nothing observed, the rules untouched. After an error
    the index no longer knows the host: the next pass must be a full `after_sync(index=)`."""
    changes, error = 0, ""
    try:
        index.update_from(keys, result.state, desired.access, local=desired.local_endpoints)
        changes = companion.write_sets(index.take())
    except KernelError as exc:
        error = str(exc)
    return CompanionResult(changes, error, _forget(companion, result))


def _forget(companion: Companion, result: SyncResult) -> int:
    """The UDP conntrack deletions for the destinations the sync removed (one process)."""
    failed = {failure.op for failure in result.report.failures}
    return forget_udp(companion.commands, udp_gone(result.plan, failed))
