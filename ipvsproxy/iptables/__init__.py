"""The iptables fallback backend: ipvsproxy's virtual servers as DNAT rules in its own chains.

Imports: iptables.*, kernel, model, policy, schedulers, errors.
"""

from ipvsproxy.iptables.kernel import IptablesKernel

__all__ = ["IptablesKernel"]
