"""ipvsproxy's dummy device and the VIPs bound to it, over rtnetlink with pyroute2.

pyroute2 is fast enough here: address changes are few per sync (one per new or removed VIP),
unlike IPVS services and destinations. The device is created if missing and left down, as
kube-proxy leaves kube-ipvs0: addresses on it are local to the host (so IPVS sees traffic to
them in LOCAL_IN) without the host answering ARP for them on any real link.

Imports: errors, model, pyroute2.
"""

from __future__ import annotations

import errno
from ipaddress import ip_address

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from ipvsproxy.errors import AlreadyExists, KernelError, KernelUnavailable, NotFound, Unsupported
from ipvsproxy.model import IPAddress

IFA_F_NODAD = 0x02  # an IPv6 VIP must not wait for duplicate address detection


class DummyDevice:
    """The device that holds ClusterIPs, externalIPs and LoadBalancer IPs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ipr = IPRoute()
        self._index: int | None = None

    def close(self) -> None:
        self._ipr.close()

    def index(self, *, create: bool) -> int | None:
        """The device's index; created first when `create` and missing."""
        if self._index is None:
            found = self._ipr.link_lookup(ifname=self.name)
            if not found and create:
                try:
                    self._ipr.link("add", ifname=self.name, kind="dummy")
                except NetlinkError as exc:
                    raise _mapped(exc, f"create dummy device {self.name}") from exc
                found = self._ipr.link_lookup(ifname=self.name)
            self._index = found[0] if found else None
        return self._index

    def addresses(self) -> frozenset[IPAddress]:
        """Addresses bound to the device (none when it does not exist)."""
        self._index = None  # the device may have been removed or re-created behind our back
        index = self.index(create=False)
        if index is None:
            return frozenset()
        return frozenset(ip_address(m.get("IFA_ADDRESS")) for m in self._ipr.get_addr(index=index))

    def bind(self, address: IPAddress) -> None:
        prefix = 32 if address.version == 4 else 128
        flags = {"flags": IFA_F_NODAD} if address.version == 6 else {}
        for attempt in (1, 2):
            index = self.index(create=True)
            try:
                self._ipr.addr("add", index=index, address=str(address), prefixlen=prefix, **flags)
                return
            except NetlinkError as exc:
                if exc.code == errno.ENODEV and attempt == 1:
                    self._index = None  # deleted since we looked it up: create it again
                    continue
                raise _mapped(exc, f"bind {address} to {self.name}") from exc

    def unbind(self, address: IPAddress) -> None:
        index = self.index(create=False)
        if index is None:
            raise NotFound(f"unbind {address}: no device {self.name}")
        prefix = 32 if address.version == 4 else 128
        try:
            self._ipr.addr("del", index=index, address=str(address), prefixlen=prefix)
        except NetlinkError as exc:
            raise _mapped(exc, f"unbind {address} from {self.name}") from exc

    def delete(self) -> bool:
        """Remove the device (and with it every bound address); False if it did not exist."""
        index = self.index(create=False)
        if index is None:
            return False
        try:
            self._ipr.link("del", index=index)
        except NetlinkError as exc:
            raise _mapped(exc, f"delete {self.name}") from exc
        self._index = None
        return True


def host_addresses() -> tuple[IPAddress, ...]:
    """Every address on this host's links (where NodePort virtual servers listen)."""
    try:
        with IPRoute() as ipr:
            return tuple(ip_address(m.get("IFA_ADDRESS")) for m in ipr.get_addr())
    except NetlinkError as exc:
        raise _mapped(exc, "list addresses") from exc


def _mapped(exc: NetlinkError, what: str) -> KernelError:
    code = exc.code
    text = f"{what}: {exc}"
    if code == errno.EEXIST:
        return AlreadyExists(text)
    if code in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.ENOENT):
        return NotFound(text)
    if code == errno.EOPNOTSUPP:
        return Unsupported(text)
    if code == errno.EPERM:
        return KernelUnavailable(text)
    return KernelError(text)
