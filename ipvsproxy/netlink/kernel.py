"""`NetlinkKernel`: the IPVS backend of the `Kernel` interface.

observe(): one service dump, one destination dump per service, and the dummy device's
addresses. apply(): consecutive IPVS operations go to the kernel as one batch (see genl.py),
and so do consecutive address operations (see rtnl.py). Kernel errnos become the project's
errors here, per operation, so one refused operation never stops the rest of a sync.

Imports: codec, fast, genl, links, nlsocket, model, kernel, errors.
"""

from __future__ import annotations

import errno
import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import groupby
from socket import AF_INET
from typing import TYPE_CHECKING

from ipvsproxy.errors import AlreadyExists, KernelError, NotFound, Unsupported
from ipvsproxy.kernel import ApplyReport, Failure, Kernel
from ipvsproxy.model import (
    DEST_WRITES,
    SERVICE_WRITES,
    AddService,
    BindAddress,
    Dests,
    IpvsState,
    Op,
    RealServer,
    RSKey,
    UnbindAddress,
    UpdateService,
    VirtualServer,
    VSKey,
    summary,
)
from ipvsproxy.netlink import codec, fast, sockopt
from ipvsproxy.netlink.genl import GenlSocket
from ipvsproxy.netlink.links import DummyDevice
from ipvsproxy.netlink.nlsocket import os_error


class NetlinkKernel:
    """IPVS over generic netlink, VIPs on a dummy device."""

    def __init__(
        self, *, device: str = "kube-ipvs0", genl: GenlSocket | None = None, legacy: bool = True
    ) -> None:
        """`legacy`: read IPv4 services through getsockopt (sockopt.py) when the kernel
        allows it; False reads everything over netlink. A `genl` passed in is closed by
        close(), but stays the caller's when construction fails; every socket opened here
        is closed when a later step fails (the dummy device's rtnetlink socket cannot be
        opened, ...), so a failed construction leaks none."""
        self._genl = genl or GenlSocket()
        try:
            self._device = DummyDevice(device)
            try:
                self._decoder = fast.DestDecoder()
                self._services = fast.ServiceDecoder()
                self._unlisted = fast.ServiceDecoder()  # beside getsockopt: IPv6, fwmarks
                # opened now: the socket answers for the network namespace it is created in
                self._legacy = _open_legacy() if legacy else None
            except BaseException:
                self._device.close()
                raise
        except BaseException:
            if genl is None:
                self._genl.close()
            raise

    def close(self) -> None:
        self._genl.close()
        self._device.close()
        if self._legacy is not None:
            self._legacy.close()

    def __enter__(self) -> NetlinkKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- observe ------------------------------------------------------------------------

    def services(self) -> dict[VSKey, VirtualServer]:
        chunks = self._genl.dump_raw(codec.CMD_GET_SERVICE)
        return {vs.key: vs for vs in self._services.decode(chunks)}

    def destinations(self, key: VSKey) -> list[tuple[RealServer, int, int]]:
        """Destinations of one service with their active and inactive connection counts."""
        if self._legacy is not None:
            try:
                entries = self._legacy.entries(key)
            except sockopt.Unavailable:
                self._drop_legacy()
            else:
                if entries is not None:
                    return entries
        chunks = self._genl.dump_raw(codec.CMD_GET_DEST, fast.service_key_nest(key))
        return self._decoder.decode(chunks, codec.family_af(key))

    def observe(self) -> IpvsState:
        # The first observation of a large table allocates tens of thousands of small objects
        # that all live on; the cyclic collector would scan them again and again while they
        # are built (none can be garbage: they hold no cycles). Paused for the dumps only.
        with _collector_paused():
            tables = self._observe_legacy() if self._legacy is not None else None
            if tables is None:
                tables = self._observe_netlink()
        return IpvsState(*tables, self._device.addresses())

    def _observe_netlink(self) -> tuple[dict[VSKey, VirtualServer], dict[VSKey, Dests]]:
        """One service dump, one destination dump per service."""
        services = self.services()
        self._decoder.start_round()
        dump, mapping = self._genl.dump_raw, self._decoder.mapping
        dests: dict[VSKey, Dests] = {
            key: mapping(dump(codec.CMD_GET_DEST, fast.service_key_nest(key)), codec.family_af(key))
            for key in services
        }
        return services, dests

    def _observe_legacy(self) -> tuple[dict[VSKey, VirtualServer], dict[VSKey, Dests]] | None:
        """IPv4 address/port services through getsockopt, one call per service for its
        destinations; IPv6 and firewall-mark services over netlink. None: the legacy
        interface is unusable here (from now on netlink alone is used)."""
        legacy = self._legacy
        assert legacy is not None
        try:
            legacy.start_round()  # before services(): it also returns written objects
            listed = legacy.services()
            chunks = self._genl.dump_raw(codec.CMD_GET_SERVICE)  # those it does not list
            unlisted = self._unlisted.decode(chunks, unlisted=True)
            others = [vs for vs in unlisted if not sockopt.lists(vs.key)]
            self._decoder.start_round()
            services: dict[VSKey, VirtualServer] = {}
            dests: dict[VSKey, Dests] = {}
            mapping, dump, nest = legacy.mapping, self._genl.dump_raw, fast.service_key_nest
            for vs, count in listed:
                key = vs.key
                try:
                    found = mapping(key, count)
                except LookupError:
                    continue  # deleted since it was listed
                if found is None:  # other-family destinations, or changed since listed
                    found = self._decoder.mapping(dump(codec.CMD_GET_DEST, nest(key)), AF_INET)
                services[key] = vs
                dests[key] = found
        except sockopt.Unavailable:
            self._drop_legacy()
            return None
        for vs in others:
            services[vs.key] = vs
            dests[vs.key] = self._decoder.mapping(
                dump(codec.CMD_GET_DEST, nest(vs.key)), codec.family_af(vs.key)
            )
        return services, dests

    def _drop_legacy(self) -> None:
        if self._legacy is not None:
            self._legacy.close()
            self._legacy = None

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        """(active, inactive) connections per destination of a service."""
        return {rs.key: (active, inactive) for rs, active, inactive in self.destinations(key)}

    # ---- apply --------------------------------------------------------------------------

    def damage(self) -> tuple[str, ...]:
        return ()  # the IPVS table has no structure beyond what IpvsState expresses

    def apply(self, plan: Sequence[Op], *, names: Mapping[VSKey, str] | None = None) -> ApplyReport:
        failures: list[Failure] = []
        for is_address, run in groupby(plan, key=lambda op: isinstance(op, _ADDRESS_OPS)):
            ops = list(run)
            if is_address:
                failures += self._apply_addresses(ops)
                continue
            try:
                codes = self._genl.batch(fast.encode_ops(ops))  # type: ignore[arg-type]
            except KernelError as err:  # the socket failed: the outcome of each is unknown
                failures += [Failure(op, err) for op in ops]
                continue
            failures += [
                Failure(op, to_error(op, c)) for op, c in zip(ops, codes, strict=True) if c
            ]
            if self._legacy is not None:
                self._legacy.wrote(_written(ops, codes))
        return ApplyReport(applied=len(plan) - len(failures), failures=tuple(failures))

    def _apply_addresses(self, ops: list[Op]) -> list[Failure]:
        """A run of bind/unbind operations as one batch (see links.DummyDevice.change)."""
        run = [op for op in ops if isinstance(op, BindAddress | UnbindAddress)]
        errors = self._device.change([(op.address, isinstance(op, BindAddress)) for op in run])
        return [Failure(op, err) for op, err in zip(run, errors, strict=True) if err]

    def set_timeouts(self, *, tcp: int = 0, tcp_fin: int = 0, udp: int = 0) -> None:
        """IPVS connection timeouts in seconds; 0 leaves one unchanged."""
        if tcp or tcp_fin or udp:
            self._genl.request(codec.CMD_SET_CONFIG, codec.timeouts_attrs(tcp, tcp_fin, udp))

    def has_device(self) -> bool:
        return self._device.index(create=False) is not None

    def remove_device(self) -> bool:
        return self._device.delete()


_ADDRESS_OPS = (BindAddress, UnbindAddress)


def _written(ops: Sequence[Op], codes: Sequence[int]) -> Iterator[VirtualServer | RealServer]:
    """The objects of the operations the kernel accepted that write one."""
    for op, code in zip(ops, codes, strict=True):
        if not code:
            if isinstance(op, DEST_WRITES):
                yield op.rs
            elif isinstance(op, SERVICE_WRITES):
                yield op.vs


def to_error(op: Op, code: int) -> KernelError:
    """The project's error for an errno the kernel returned for `op`."""
    text = f"{summary(op)}: {os_error(code)}"
    if code == errno.EEXIST:
        return AlreadyExists(text)
    if code == errno.ENOENT and isinstance(op, AddService | UpdateService):
        # ip_vs_ctl.c: ENOENT from NEW/SET_SERVICE means the scheduler module is missing
        return Unsupported(f"{text}: scheduler module ip_vs_{op.vs.scheduler} not available")
    if code in (errno.ESRCH, errno.ENOENT):
        return NotFound(text)
    if code in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EOPNOTSUPP):
        return Unsupported(text)
    return KernelError(text)


def _open_legacy() -> sockopt.SockoptReader | None:
    try:
        return sockopt.SockoptReader()
    except sockopt.Unavailable:
        return None


if TYPE_CHECKING:
    _conforms: Kernel = NetlinkKernel()


@contextmanager
def _collector_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
