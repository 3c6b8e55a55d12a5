"""The companion part of a sync pass: after IPVS, bring the sets and rules in line and
forget the UDP conntrack entries of removed endpoints.

Owns: `after_sync()` and `CompanionResult`. Runs with the IPVS backend only (the iptables
fallback masquerades in its own chains).

Imports: companion.*, sync (its results and desired state), model, errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipvsproxy.api import NodeView
from ipvsproxy.companion.conntrack import forget_udp
from ipvsproxy.companion.kernel import Companion
from ipvsproxy.companion.rules import LocalMode, Options
from ipvsproxy.companion.sets import SetState, wanted
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.model import DeleteDest, DeleteService, IpvsState, Proto, RSKey, VSKey
from ipvsproxy.sync.desired import Desired
from ipvsproxy.sync.engine import SyncResult


@dataclass(frozen=True, slots=True)
class CompanionResult:
    changes: int = 0  # ipset entries and chains written
    error: str = ""  # why the companion part failed ("" = it did not)
    forgotten: int = 0  # conntrack deletions asked for


def options_for(config: Config, node: NodeView) -> Options:
    """The rules' options: the flags, and for NodeCIDR the Node's pod CIDRs."""
    mode = LocalMode(config.detect_local_mode)
    cidrs = node.pod_cidrs if mode is LocalMode.NODE_CIDR else config.cluster_cidrs
    return Options(
        masquerade_bit=config.masquerade_bit,
        masquerade_all=config.masquerade_all,
        local_mode=mode,
        local_cidrs=tuple(cidrs),
        interface=config.local_interface,
    )


def wanted_of(state: IpvsState, desired: Desired) -> SetState:
    """The sets for a synced state: each virtual server's access, this node's endpoints."""
    return wanted(state, desired.access, local=desired.local_endpoints)


def after_sync(
    companion: Companion, result: SyncResult, desired: Desired, options: Options
) -> CompanionResult:
    """Make the host's companion sets and rules match what the sync asked of IPVS."""
    changes, error = 0, ""
    companion.options = options
    try:
        plan = companion.plan(wanted_of(result.state, desired))
        if plan:
            companion.apply(plan)
            changes = len(plan.describe())
    except KernelError as exc:
        error = str(exc)
    failed = {failure.op for failure in result.report.failures}
    gone: list[tuple[VSKey, RSKey | None]] = []
    for op in result.plan:
        if op in failed:
            continue
        if isinstance(op, DeleteDest) and op.service.proto is Proto.UDP:
            gone.append((op.service, op.key))
        elif isinstance(op, DeleteService) and op.key.proto is Proto.UDP:
            gone.append((op.key, None))
    return CompanionResult(changes, error, forget_udp(companion.commands, gone))
