"""ipvsproxy's dummy device and the VIPs bound to it, over rtnetlink (rtnl.py).

The device is looked up, created and deleted with single requests (rare). Addresses are
bound, unbound and listed in batches: one batch of requests per run of address operations,
not a request and an ack per address (1000 VIPs for 1000 Services). The device is created if
missing and left down, as kube-proxy leaves kube-ipvs0: addresses on it are local to the
host (so IPVS sees traffic to them in LOCAL_IN) without the host answering ARP for them on
any real link.

Imports: errors, model, nlsocket, rtnl.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

from ipvsproxy.errors import AlreadyExists, KernelError, KernelUnavailable, NotFound, Unsupported
from ipvsproxy.model import IPAddress
from ipvsproxy.netlink.nlsocket import os_error
from ipvsproxy.netlink.rtnl import AddressEvents, RtnlSocket


class DummyDevice:
    """The device that holds ClusterIPs, externalIPs and LoadBalancer IPs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._rtnl = RtnlSocket()  # answers for the namespace it is opened in
        self._index: int | None = None
        try:  # before the first dump: a change after it is then seen
            self._events: AddressEvents | None = AddressEvents()
        except OSError:
            self._events = None
        self._bound: frozenset[IPAddress] | None = None  # the last dump's addresses

    def close(self) -> None:
        self._rtnl.close()
        if self._events is not None:
            self._events.close()

    def index(self, *, create: bool) -> int | None:
        """The device's index; created first when `create` and missing."""
        if self._index is None:
            found = self._lookup()
            if found is None and create:
                try:
                    self._rtnl.create_link(self.name, "dummy")
                except OSError as exc:
                    raise _mapped(exc, f"create dummy device {self.name}") from exc
                found = self._lookup()
            self._index = found
        return self._index

    def _lookup(self) -> int | None:
        try:
            return self._rtnl.link_index(self.name)
        except OSError as exc:
            raise _mapped(exc, f"look up {self.name}") from exc

    def addresses(self) -> frozenset[IPAddress]:
        """Addresses bound to the device (none when it does not exist); dumped again only
        when a link or address changed since the last dump (AddressEvents)."""
        changed = self._events is None or self._events.changed()  # drained at every look
        if self._bound is not None and not changed:
            return self._bound
        self._bound = None  # until this dump succeeds
        self._index = None  # the device may have been removed or re-created behind our back
        index = self.index(create=False)
        self._bound = self._rtnl.addresses(index) if index is not None else frozenset()
        return self._bound

    def change(self, changes: Sequence[tuple[IPAddress, bool]]) -> list[KernelError | None]:
        """Bind (True) or unbind (False) each address as a host address, in order, in one
        batch; the error of each (None: done). A bind creates the device when missing."""
        try:
            index = self.index(create=any(add for _, add in changes))
        except KernelError as err:
            return [err] * len(changes)
        if index is None:  # only unbinds, and no device
            return [NotFound(f"unbind {a}: no device {self.name}") for a, _ in changes]
        try:
            codes = self._rtnl.change(index, changes)
        except KernelError as err:  # the socket failed: the outcome of each is unknown
            return [err] * len(changes)
        errors = [self._error(change, code) for change, code in zip(changes, codes, strict=True)]
        again = [i for i, code in enumerate(codes) if code == errno.ENODEV and changes[i][1]]
        if again:  # the device was deleted since we looked it up: create it again, once
            self._index = None
            try:
                index = self.index(create=True)
            except KernelError as err:
                for i in again:
                    errors[i] = err
                return errors
            # index 0 (still no device after creating it): ENODEV again, NotFound
            try:
                retried = self._rtnl.change(index or 0, [changes[i] for i in again])
            except KernelError as err:
                for i in again:
                    errors[i] = err
                return errors
            for i, code in zip(again, retried, strict=True):
                errors[i] = self._error(changes[i], code)
        return errors

    def _error(self, change: tuple[IPAddress, bool], code: int) -> KernelError | None:
        address, add = change
        if not code:
            return None
        what = f"bind {address} to" if add else f"unbind {address} from"
        return error_for(code, f"{what} {self.name}: {os_error(code)}")

    def delete(self) -> bool:
        """Remove the device (and with it every bound address); False if it did not exist."""
        index = self.index(create=False)
        if index is None:
            return False
        self._index = None
        try:
            self._rtnl.delete_link(index)
        except OSError as exc:
            raise _mapped(exc, f"delete {self.name}") from exc
        return True


def host_addresses() -> tuple[IPAddress, ...]:
    """Every address on this host's links (where NodePort virtual servers listen): one
    RTM_GETADDR dump of every link, as pyroute2's get_addr() reports them (IFA_ADDRESS)."""
    sock = RtnlSocket()
    try:
        return tuple(sock.all_addresses())
    except OSError as exc:
        raise _mapped(exc, "list addresses") from exc
    finally:
        sock.close()


class NodeAddresses:
    """`node_addresses()` read again only after a link or address changed (AddressEvents):
    what the proxier calls at every full pass. Open it in the namespace to watch."""

    def __init__(self, dummy_device: str) -> None:
        self._dummy = dummy_device
        try:
            self._events: AddressEvents | None = AddressEvents()
        except OSError:
            self._events = None
        self._last: tuple[IPAddress, ...] | None = None

    def __call__(self) -> tuple[IPAddress, ...]:
        changed = self._events is None or self._events.changed()  # drained at every look
        if self._last is not None and not changed:
            return self._last
        self._last = None  # until this read succeeds
        self._last = node_addresses(self._dummy)
        return self._last

    def close(self) -> None:
        if self._events is not None:
            self._events.close()


def node_addresses(dummy_device: str) -> tuple[IPAddress, ...]:
    """This node's own addresses, as kube-proxy's IPVS mode takes them for NodePorts and
    for telling a node address from a VIP: every link's but the dummy device's (those are
    VIPs), without loopback and link-local ones (not reachable from other hosts). Two
    dump of every address, the dummy device's skipped unparsed (a large cluster has 1,000s
    of VIPs there: parsing them was most of an idle resync's cost)."""
    sock = RtnlSocket()
    try:
        index = sock.link_index(dummy_device) or 0
        found = dict.fromkeys(
            a
            for a in sock.all_addresses(exclude=index)
            if not a.is_loopback and not a.is_link_local
        )
        return tuple(found)
    except OSError as exc:
        raise _mapped(exc, "list addresses") from exc
    finally:
        sock.close()


def _mapped(exc: OSError, what: str) -> KernelError:
    code = exc.errno or 0
    return error_for(code, f"{what}: {os_error(code) if code else exc}")


def error_for(code: int, text: str) -> KernelError:
    """The project's error for an errno of an address or link request."""
    if code == errno.EEXIST:
        return AlreadyExists(text)
    if code in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.ENOENT):
        return NotFound(text)
    if code == errno.EOPNOTSUPP:
        return Unsupported(text)
    if code == errno.EPERM:
        return KernelUnavailable(text)
    return KernelError(text)
