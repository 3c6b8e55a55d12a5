"""Is IPVS usable here? Probe the kernel, do not read module lists.

Usable when the "IPVS" generic-netlink family exists and a probe virtual server (in
TEST-NET-2, as kube-proxy's probe) with the configured scheduler can be created, read back
and deleted.

Imports: codec, genl, kernel, model, schedulers, errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import ip_address

from ipvsproxy.errors import AlreadyExists, KernelError
from ipvsproxy.model import AddService, DeleteService, Proto, VirtualServer, VSKey
from ipvsproxy.netlink import codec
from ipvsproxy.netlink.genl import GenlSocket
from ipvsproxy.netlink.ipvs_kernel import to_error
from ipvsproxy.schedulers import Scheduler

PROBE_KEY = VSKey(ip_address("198.51.100.0"), 20000, Proto.TCP)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    usable: bool
    reason: str


def probe(scheduler: Scheduler) -> ProbeResult:
    """Try IPVS for real with `scheduler`; never raises."""
    try:
        genl = GenlSocket()
    except KernelError as exc:
        return ProbeResult(False, str(exc))
    try:
        return _probe(genl, VirtualServer(PROBE_KEY, scheduler))
    except (KernelError, OSError) as exc:
        return ProbeResult(False, f"IPVS probe failed: {exc}")
    finally:
        genl.close()


def _probe(genl: GenlSocket, vs: VirtualServer) -> ProbeResult:
    add = AddService(vs)
    delete = DeleteService(vs.key)
    (code,) = genl.batch([codec.encode_op(add)])
    if code and isinstance(to_error(add, code), AlreadyExists):
        genl.batch([codec.encode_op(delete)])  # a leftover of an interrupted probe
        (code,) = genl.batch([codec.encode_op(add)])
    if code:
        return ProbeResult(False, f"cannot create a probe virtual server: {to_error(add, code)}")
    try:
        chunks = genl.dump_raw(codec.CMD_GET_SERVICE)
        seen = [codec.decode_service(payload) for payload in codec.dumped(chunks)]
        if vs not in seen:
            return ProbeResult(False, "the probe virtual server did not read back as written")
    finally:
        (code,) = genl.batch([codec.encode_op(delete)])
    if code:
        return ProbeResult(
            False, f"cannot delete the probe virtual server: {to_error(delete, code)}"
        )
    return ProbeResult(True, f"IPVS works with scheduler {vs.scheduler}")
