#!/usr/bin/env python3
"""k.py - small API helpers for the lab (its own venv: kubernetes + pyyaml).

  k.py fake-ccm NODE INTERNAL_IP POD_CIDR [TIMEOUT [ZONE]]
      wait for Node NODE (registered by the kubelet with --cloud-provider=external), then do what a
      cloud controller would: status.addresses = [InternalIP INTERNAL_IP, Hostname localhost] (the
      apiserver dials a kubelet at its Hostname address first: localhost:10250 on the host is
      QEMU's forward to the guest kubelet: each node's on its own port), spec.podCIDR(s) =
      POD_CIDR, and remove the
      node.cloudprovider.kubernetes.io/uninitialized taint; with ZONE, the label
      topology.kubernetes.io/zone.
  k.py wait-ready NODE TIMEOUT          wait until Node NODE is Ready
  k.py sa-kubeconfig NS SA SERVER OUT [SECONDS]
      TokenRequest for ServiceAccount NS/SA, written as a kubeconfig (server SERVER, the rig's CA,
      tls-server-name 127.0.0.1) to OUT
  k.py service-ca
      runs until killed: every namespace gets a ConfigMap openshift-service-ca.crt with the key
      service-ca.crt (the rig's CA). The rig's kube-apiserver carries OpenShift's patch of the
      ServiceAccount admission plugin, which adds that ConfigMap to every Pod's projected token
      volume (not optional); in OpenShift the service-ca operator fills it. Without it no Pod
      that mounts a ServiceAccount token can start.
  k.py dns-service NODE NODE_IP [CLUSTER_IP]
      Service kube-system/kube-dns (CLUSTER_IP, default 10.96.0.10; ports dns 53/UDP,
      dns-tcp 53/TCP,
      no selector) and its EndpointSlice kube-dns-rig: one endpoint NODE_IP on NODE, where dns.py
      listens in the VM. Pods reach the cluster DNS through the Service proxy under test.
Uses $KUBECONFIG (default $RIG/kubeconfig).
"""

import base64
import os
import pathlib
import sys
import time

from kubernetes import client, config
from kubernetes.client.rest import ApiException

RIG = os.environ["RIG"]  # the lab's folder (lab sets it)
config.load_kube_config(os.environ.get("KUBECONFIG", f"{RIG}/kubeconfig"))
v1 = client.CoreV1Api()


def wait_node(name, timeout):
    end = time.time() + timeout
    while True:
        try:
            return v1.read_node(name)
        except ApiException as e:
            if e.status != 404 or time.time() > end:
                raise
        time.sleep(1)


def fake_ccm(name, ip, cidr, timeout=300, zone=None):
    node = wait_node(name, float(timeout))
    if zone:  # as a cloud's node controller labels a node
        v1.patch_node(name, {"metadata": {"labels": {"topology.kubernetes.io/zone": zone}}})
    v1.patch_node_status(
        name,
        [
            {
                "op": "replace",
                "path": "/status/addresses",
                "value": [
                    {"type": "InternalIP", "address": ip},
                    {"type": "Hostname", "address": "localhost"},
                ],
            }
        ],
    )
    taints = [
        t
        for t in (node.spec.taints or [])
        if t.key != "node.cloudprovider.kubernetes.io/uninitialized"
    ]
    ops = [
        {
            "op": "replace" if node.spec.taints is not None else "add",
            "path": "/spec/taints",
            "value": [client.ApiClient().sanitize_for_serialization(t) for t in taints],
        }
    ]
    if not node.spec.pod_cidr:
        ops += [
            {"op": "add", "path": "/spec/podCIDR", "value": cidr},
            {"op": "add", "path": "/spec/podCIDRs", "value": [cidr]},
        ]
    v1.patch_node(name, ops)
    n = v1.read_node(name)
    print(
        f"node {name}: addresses {[(a.type, a.address) for a in n.status.addresses]}, "
        f"podCIDR {n.spec.pod_cidr}, taints {[t.key for t in (n.spec.taints or [])]}"
    )


def wait_ready(name, timeout):
    end = time.time() + float(timeout)
    while time.time() < end:
        try:
            n = v1.read_node(name)
            for c in n.status.conditions or []:
                if c.type == "Ready" and c.status == "True":
                    print(f"node {name} Ready")
                    return 0
        except ApiException as e:
            if e.status != 404:
                raise
        time.sleep(1)
    print(f"node {name} not Ready after {timeout} s", file=sys.stderr)
    return 1


def sa_kubeconfig(ns, sa, server, out, seconds=86400):
    tr = v1.create_namespaced_service_account_token(
        sa,
        ns,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=int(seconds))
        ),
    )
    ca = base64.b64encode(pathlib.Path(f"{RIG}/pki/ca.crt").read_bytes()).decode()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"""apiVersion: v1
kind: Config
clusters:
- name: rig
  cluster:
    server: {server}
    tls-server-name: 127.0.0.1
    certificate-authority-data: {ca}
users:
- name: {ns}-{sa}
  user:
    token: {tr.status.token}
contexts:
- name: sa
  context: {{cluster: rig, user: {ns}-{sa}}}
current-context: sa
""")
    print(f"wrote {out} (token of {ns}/{sa}, expires {tr.status.expiration_timestamp})")


def service_ca():
    from kubernetes import watch

    ca = pathlib.Path(f"{RIG}/pki/ca.crt").read_text()
    name = "openshift-service-ca.crt"

    def ensure(ns):
        body = client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=name), data={"service-ca.crt": ca}
        )
        try:
            cm = v1.read_namespaced_config_map(name, ns)
            if (cm.data or {}).get("service-ca.crt") != ca:
                v1.patch_namespaced_config_map(name, ns, {"data": {"service-ca.crt": ca}})
        except ApiException as e:
            if e.status == 404:
                try:
                    v1.create_namespaced_config_map(ns, body)
                    print(f"created {ns}/{name}", flush=True)
                except ApiException as e2:
                    if e2.status not in (409, 403, 404):  # exists / namespace terminating / gone
                        print(f"{ns}: {e2.status} {e2.reason}", flush=True)
            elif e.status != 403:
                print(f"{ns}: {e.status} {e.reason}", flush=True)

    while True:
        try:
            lst = v1.list_namespace()
            for ns in lst.items:
                if ns.status.phase == "Active":
                    ensure(ns.metadata.name)
            w = watch.Watch()
            for ev in w.stream(
                v1.list_namespace,
                resource_version=lst.metadata.resource_version,
                timeout_seconds=60,
            ):
                ns = ev["object"]
                if ev["type"] in ("ADDED", "MODIFIED") and ns.status.phase == "Active":
                    ensure(ns.metadata.name)
        except Exception as e:  # relist on anything (410 Gone, lost connection)
            print(f"service-ca: {type(e).__name__}: {e}", flush=True)
            time.sleep(1)


def dns_service(node, ip, cluster_ip="10.96.0.10"):
    svc = {
        "metadata": {
            "name": "kube-dns",
            "namespace": "kube-system",
            "labels": {"k8s-app": "kube-dns"},
        },
        "spec": {
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
            ],
        },
    }
    try:
        cur = v1.read_namespaced_service("kube-dns", "kube-system")
        if cur.spec.cluster_ip != cluster_ip or cur.spec.selector:
            sys.exit(
                f"kube-system/kube-dns exists with clusterIP {cur.spec.cluster_ip}, "
                f"selector {cur.spec.selector}"
            )
    except ApiException as e:
        if e.status != 404:
            raise
        v1.create_namespaced_service("kube-system", svc)
    d = client.DiscoveryV1Api()
    es = {
        "metadata": {
            "name": "kube-dns-rig",
            "namespace": "kube-system",
            "labels": {
                "kubernetes.io/service-name": "kube-dns",
                "endpointslice.kubernetes.io/managed-by": "rig.local",
            },
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": node}],
    }
    try:
        d.replace_namespaced_endpoint_slice(
            "kube-dns-rig",
            "kube-system",
            {
                **es,
                "metadata": {
                    **es["metadata"],
                    "resourceVersion": d.read_namespaced_endpoint_slice(
                        "kube-dns-rig", "kube-system"
                    ).metadata.resource_version,
                },
            },
        )
    except ApiException as e:
        if e.status != 404:
            raise
        d.create_namespaced_endpoint_slice("kube-system", es)
    print(f"kube-system/kube-dns {cluster_ip} -> {ip}:53 (udp, tcp) on {node}")


cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "fake-ccm":
    fake_ccm(*args)
elif cmd == "wait-ready":
    sys.exit(wait_ready(*args))
elif cmd == "service-ca":
    service_ca()
elif cmd == "dns-service":
    dns_service(*args)
elif cmd == "sa-kubeconfig":
    sa_kubeconfig(*args)
else:
    sys.exit(f"unknown command {cmd}")
