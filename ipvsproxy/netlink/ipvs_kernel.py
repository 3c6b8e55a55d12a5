"""`NetlinkKernel`: the IPVS backend of the `Kernel` interface.

observe(): one service dump, one destination dump per service, and the dummy device's
addresses. apply(): consecutive IPVS operations go to the kernel as one batch (see genl.py),
and so do consecutive address operations (see rtnl.py). Kernel errnos become the project's
errors here, per operation, so one refused operation never stops the rest of a sync.

Imports: codec, genl, links, nlsocket, model, kernel, errors.
"""

from __future__ import annotations

import errno
import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import groupby
from typing import TYPE_CHECKING

from ipvsproxy.errors import AlreadyExists, KernelError, NotFound, Unsupported
from ipvsproxy.kernel import AccessMap, ApplyReport, Failure, Kernel
from ipvsproxy.model import (
    AddService,
    BindAddress,
    Dests,
    IpvsState,
    Op,
    RealServer,
    RSKey,
    Traffic,
    UnbindAddress,
    UpdateService,
    VirtualServer,
    VSKey,
    summary,
)
from ipvsproxy.netlink import codec
from ipvsproxy.netlink.genl import GenlSocket
from ipvsproxy.netlink.links import DummyDevice
from ipvsproxy.netlink.nlsocket import os_error


class NetlinkKernel:
    """IPVS over generic netlink, VIPs on a dummy device."""

    owns_table = False  # the kernel's IPVS table is shared with whoever else uses IPVS

    def __init__(self, *, device: str = "kube-ipvs0", genl: GenlSocket | None = None) -> None:
        """A `genl` passed in is closed by close(), but stays the caller's when construction
        fails; every socket opened here is closed when a later step fails."""
        self._genl = genl or GenlSocket()
        try:
            self._device = DummyDevice(device)
        except BaseException:
            if genl is None:
                self._genl.close()
            raise

    def close(self) -> None:
        self._genl.close()
        self._device.close()

    def __enter__(self) -> NetlinkKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- observe ------------------------------------------------------------------------

    def services(self) -> dict[VSKey, VirtualServer]:
        """Every virtual server ipvsproxy can model (codec.decode_service), in one dump."""
        found = map(codec.decode_service, codec.dumped(self._genl.dump_raw(codec.CMD_GET_SERVICE)))
        return {vs.key: vs for vs in found if vs is not None}

    def destinations(self, key: VSKey) -> list[tuple[RealServer, int, int]]:
        """Destinations of one service with their active and inactive connection counts."""
        chunks = self._genl.dump_raw(codec.CMD_GET_DEST, codec.service_nest(key))
        af = codec.family_af(key)
        return [codec.decode_dest(payload, af) for payload in codec.dumped(chunks)]

    def observe(self, *, access: AccessMap | None = None) -> IpvsState:
        """One service dump, one destination dump per service, the dummy device's
        addresses."""
        # The first observation of a large table allocates tens of thousands of small objects
        # that all live on; the cyclic collector would scan them again and again while they
        # are built (none can be garbage: they hold no cycles). Paused for the dumps only.
        with _collector_paused():
            services = self.services()
            dests: dict[VSKey, Dests] = {
                key: {rs.key: rs for rs, _, _ in self.destinations(key)} for key in services
            }
        return IpvsState(services, dests, self._device.addresses())

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        """(active, inactive) connections per destination of a service."""
        return {rs.key: (active, inactive) for rs, active, inactive in self.destinations(key)}

    def traffic(self) -> dict[VSKey, Traffic]:
        return read_traffic(self._genl)

    # ---- apply --------------------------------------------------------------------------

    def damage(self) -> tuple[str, ...]:
        return ()  # the IPVS table has no structure beyond what IpvsState expresses

    def apply(
        self,
        plan: Sequence[Op],
        *,
        names: Mapping[VSKey, str] | None = None,
        access: AccessMap | None = None,
    ) -> ApplyReport:
        failures: list[Failure] = []
        for is_address, run in groupby(plan, key=lambda op: isinstance(op, _ADDRESS_OPS)):
            ops = list(run)
            if is_address:
                failures += self._apply_addresses(ops)
                continue
            try:
                codes = self._genl.batch([codec.encode_op(op) for op in ops])  # type: ignore[arg-type]
            except KernelError as err:  # the socket failed: the outcome of each is unknown
                failures += [Failure(op, err) for op in ops]
                continue
            failures += [
                Failure(op, to_error(op, c)) for op, c in zip(ops, codes, strict=True) if c
            ]
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


def read_traffic(genl: GenlSocket) -> dict[VSKey, Traffic]:
    """Counters of every virtual server ipvsproxy can model and of its destinations: the
    same dumps as observe(), their statistics decoded."""
    chunks = genl.dump_raw(codec.CMD_GET_SERVICE)
    found = filter(None, map(codec.decode_service_traffic, codec.dumped(chunks)))
    out: dict[VSKey, Traffic] = {}
    for key, counters in found:
        dumped = codec.dumped(genl.dump_raw(codec.CMD_GET_DEST, codec.service_nest(key)))
        af = codec.family_af(key)
        out[key] = Traffic(counters, dict(codec.decode_dest_traffic(p, af) for p in dumped))
    return out


class CounterReader:
    """A generic-netlink connection that reads the IPVS counters and nothing else (what
    traffic.TrafficReader opens): no dummy device, so no address-event subscription that
    nobody reads."""

    def __init__(self) -> None:
        self._genl = GenlSocket()

    def traffic(self) -> dict[VSKey, Traffic]:
        return read_traffic(self._genl)

    def close(self) -> None:
        self._genl.close()
