"""The iptables fallback backend: ipvsproxy's virtual servers as DNAT rules in its own chains.

Imports: iptables.*, kernel, model, schedulers, errors.
"""

from ipvsproxy.iptables.kernel import Commands, IptablesKernel

__all__ = ["Commands", "IptablesKernel"]
