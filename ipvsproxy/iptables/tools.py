"""Running the iptables tools: which ones, and one `iptables-restore --noflush` run.

Owns: `TOOLS` (the save and restore tools of each IP version), `restore_argv()` and
`restore()`, with kube-proxy's wait for the xtables lock. The firewall, the fallback and
`cleanup --kube-proxy` all restore through it; host.commands' `Commands` (with a prefix such
as `ip netns exec NS`) runs them.

Imports: host.commands, errors.
"""

from __future__ import annotations

from ipvsproxy.errors import KernelError, KernelUnavailable, RestoreFailed
from ipvsproxy.host.commands import Commands

TOOLS = {4: ("iptables-save", "iptables-restore"), 6: ("ip6tables-save", "ip6tables-restore")}
# kube-proxy's values: wait up to 5 s for the xtables lock, polling every 100 ms. Without them
# iptables-legacy's restore fails at once while the kubelet, a CNI plugin or Docker holds the
# lock. iptables-save takes no -w (1.8.9, legacy and nf_tables: "invalid option"), and needs
# none: legacy's save only reads, nf_tables has no lock.
RESTORE_WAIT = ("-w", "5", "-W", "100000")


def restore_argv(version: int) -> list[str]:
    """`iptables-restore` (or ip6tables-) with the xtables lock wait and `--noflush`."""
    return [TOOLS[version][1], *RESTORE_WAIT, "--noflush"]


def restore(commands: Commands, version: int, payload: str) -> None:
    """One `iptables-restore --noflush` run of `payload`; RestoreFailed (its IP version
    named, for the metric) when it fails, KernelUnavailable without the tool."""
    try:
        commands.run(restore_argv(version), stdin=payload)
    except KernelUnavailable:
        raise
    except KernelError as exc:
        raise RestoreFailed(str(exc), version=version) from exc
