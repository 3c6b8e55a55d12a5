"""Services for real-traffic tests, programmed through ipvsproxy's own pass (the proxier the
agent runs: tracker, translation, plan, apply) into any backend: the lab's backends are the
endpoints."""

from __future__ import annotations

from ipaddress import ip_network
from typing import Any

from integration.lab import PORT, Lab
from ipvsproxy.config import Config
from ipvsproxy.kernel import Kernel
from ipvsproxy.proxier import Proxier
from tests.factories import ep, node, port, service, slice_
from tests.support import Synced

NODE_IP = "10.250.1.1"
# The bundled example's pods (node-a's and node-b's), with the ports their EndpointSlices name.
EXAMPLE_PODS = {
    "10.244.1.2": (8000, 5353),
    "10.244.1.3": (8000,),
    "10.244.1.4": (8000, 8443),
    "10.244.2.5": (5353,),
    "10.244.2.6": (8000,),
    "10.244.2.7": (8443,),
}
EXAMPLE_NODE_ADDRESS = "172.31.0.10"  # node-a's InternalIP in the example
CONFIG = Config(node_name="node-a", service_cidrs=(ip_network("10.96.0.0/16"),))


def program(kernel: Kernel, lab: Lab, *services: dict[str, Any]) -> Synced:
    """Services with the lab's backends as endpoints, through one full pass of the proxier;
    a second full pass finds nothing to do."""
    objects = [node(addresses=(NODE_IP,))]
    for svc in services:
        name = svc["metadata"]["name"]
        svc_port = svc["spec"]["ports"][0]
        objects += [
            svc,
            slice_(
                name,
                ports=((svc_port["name"], PORT, svc_port.get("protocol", "TCP")),),
                endpoints=[ep(b.address) for b in lab.backends],
            ),
        ]
    synced = Synced(Proxier(kernel=kernel, config=CONFIG))
    result = synced.sync(objects)
    assert result.sync.report.failures == ()
    assert result.ok
    assert synced.sync(objects).sync.plan == ()
    return synced


def svc(
    name: str, vip: str, *, scheduler: str = "rr", proto: str = "TCP", **spec: Any
) -> dict[str, Any]:
    made: dict[str, Any] = service(
        name,
        cluster_ips=(vip,),
        ports=[port("p", 80, proto, PORT, spec.pop("node_port", None))],
        annotations={"ipvsproxy.io/scheduler": scheduler},
        **spec,
    )
    return made
