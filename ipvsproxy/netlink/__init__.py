"""The IPVS backend over netlink: the only package that imports pyroute2."""

from ipvsproxy.netlink.kernel import NetlinkKernel
from ipvsproxy.netlink.probe import ProbeResult, probe

__all__ = ["NetlinkKernel", "ProbeResult", "probe"]
