"""The IPVS backend over netlink, hand-written (see links.py and genl.py for why); pyroute2
is no longer imported by the product, only by tests that check our bytes against its own."""

from ipvsproxy.netlink.ipvs_kernel import CounterReader, NetlinkKernel
from ipvsproxy.netlink.probe import ProbeResult, probe

__all__ = ["CounterReader", "NetlinkKernel", "ProbeResult", "probe"]
