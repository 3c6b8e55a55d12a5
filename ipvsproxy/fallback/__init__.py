"""The iptables fallback backend: ipvsproxy's virtual servers as DNAT rules in its own chains.

Modules: `backend` (`IptablesKernel`, the `Kernel` interface), `chains` (IPVS state
-> its chains, as `iptables-save` prints them), `chain_reader` (its saved chains -> IPVS
state), `chain_table` (what its chains hold, kept up to date operation by operation). The
iptables text toolkit it shares with the firewall is ipvsproxy/iptables/.

Imports: iptables.*, host.commands, kernel, model, policy, schedulers, errors.
"""

from ipvsproxy.fallback.backend import IptablesKernel

__all__ = ["IptablesKernel"]
