#!/usr/bin/env bash
# guest.sh RUN_DIR - runs INSIDE one node VM of the lab (virtme-ng, Debian's kernel with IPVS), as
# root, started by ./lab up. Turns the VM into a Kubernetes node joined to the lab's control plane:
#   NICs      user net (MAC 52:54:00:00:00:0N): 10.0.2.15/24, the host (API server) at 10.0.2.2;
#             the lab link (MAC 52:54:00:77:00:0N, qemu's multicast socket on the host's loopback:
#             one Ethernet segment for every node VM): $LAB_IP/24, the node's InternalIP
#   routes    each other node's pod CIDR via its lab address ($ROUTES); the Service CIDR unreachable
#   storage   tmpfs for containerd (overlayfs does not work on the 9p root), kubelet, CNI state
#   containerd the images in $IMG_DIR named by $IMAGES, imported at boot
#   CNI       bridge cni0 + host-local ($POD_CIDR), no ipMasq: pod-to-pod traffic between nodes
#             keeps its source address; pods' traffic leaving 10.244.0.0/16 is masqueraded here
#   kubelet   $NODE_NAME, --node-ip $LAB_IP, port $KUBELET_PORT (the host forwards it), cgroupfs
# Then runs RUN_DIR/cmd/*.sh (./lab exec): output in *.out, exit status in *.rc; powers off when
# RUN_DIR/stop appears. Logs: RUN_DIR/log/. Settings: RUN_DIR/env (written by ./lab up).
set -u
R=$1
. "$R/env"
mkdir -p "$R/log" "$R/cmd"
exec >>"$R/log/guest.log" 2>&1
say() { echo "$(date +%H:%M:%S.%N | cut -c1-12) $*"; }
say "guest start ($(uname -r), $(nproc) cpus, $(free -m | awk '/Mem:/{print $2}') MiB)"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# ---- kernel: only what containerd and the bridge need (each proxy loads its IPVS modules) --------
for m in overlay br_netfilter bridge veth; do modprobe "$m" 2>/dev/null || say "modprobe $m failed"; done
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
hostname "$NODE_NAME"
echo "127.0.0.1 localhost $NODE_NAME" >/etc/hosts

# ---- network ----------------------------------------------------------------------------------
nic() { # MAC -> interface name
  local d
  for d in /sys/class/net/*; do [ "$(cat "$d/address")" = "$1" ] && { echo "${d##*/}"; return; }; done
}
UP=$(nic "$USER_MAC") LINK=$(nic "$LAB_MAC")
[ -n "$UP" ] && [ -n "$LINK" ] || { say "NICs not found (user $USER_MAC: '$UP', lab $LAB_MAC: '$LINK')"; ip link; poweroff -f; }
ip link set lo up
ip link set "$UP" up
ip addr add 10.0.2.15/24 dev "$UP"
ip route add default via 10.0.2.2 dev "$UP"
ip link set "$LINK" up
ip addr add "$LAB_IP/24" dev "$LINK"
for r in $ROUTES; do ip route add "${r%@*}" via "${r#*@}" dev "$LINK"; done
# the Service CIDR is routed nowhere on a real cluster (here the default route would lead to the
# host's egress proxy, which answers any port 80): only VIPs a proxy binds are reachable
ip route add unreachable "$SERVICE_CIDR"
# pods' traffic to anything outside the cluster network (the API server through the user net)
# leaves with the node's address, as a CNI's masquerade does; pod to pod keeps its source
iptables -t nat -N LAB-MASQ
iptables -t nat -A LAB-MASQ -d 10.244.0.0/16 -j RETURN
iptables -t nat -A LAB-MASQ -d "$SERVICE_CIDR" -j RETURN
iptables -t nat -A LAB-MASQ -j MASQUERADE
iptables -t nat -A POSTROUTING -s 10.244.0.0/16 -j LAB-MASQ
say "network: $UP 10.0.2.15 (user net), $LINK $LAB_IP (lab link), routes: $ROUTES"

if [ -n "${DNS_CMD:-}" ]; then
  setsid nohup $DNS_CMD >"$R/log/dns.log" 2>&1 </dev/null &
  say "cluster DNS started: $DNS_CMD"
fi

# ---- storage ------------------------------------------------------------------------------------
for d in /var/lib/containerd /run/containerd /var/lib/kubelet /var/lib/cni /var/log/pods /var/log/containers; do
  mkdir -p "$d" && mount -t tmpfs tmpfs "$d"
done
mkdir -p /etc/containerd /etc/cni/net.d
rm -f /etc/cni/net.d/*

# ---- containerd ---------------------------------------------------------------------------------
cat >/etc/containerd/config.toml <<TOML
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10.2"
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
TOML
cat >/etc/cni/net.d/10-lab.conflist <<JSON
{
  "cniVersion": "0.4.0",
  "name": "lab",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "/var/lib/cni/networks"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
containerd --config /etc/containerd/config.toml >"$R/log/containerd.log" 2>&1 &
echo $! >/run/containerd.pid
for _ in $(seq 1 120); do ctr version >/dev/null 2>&1 && break; sleep 0.5; done
say "containerd up"
for i in $IMAGES; do
  s=$(date +%s)
  ctr -n k8s.io images import "$IMG_DIR/$i.tar" >/dev/null && say "imported $i ($(( $(date +%s) - s )) s)" || say "import of $i FAILED"
done

# ---- kubelet ------------------------------------------------------------------------------------
cat >/var/lib/kubelet/config.yaml <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
clusterDomain: cluster.local
clusterDNS: [$CLUSTER_DNS]
resolvConf: /etc/resolv.conf
port: $KUBELET_PORT
readOnlyPort: 0
serializeImagePulls: false
evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
maxPods: 110
podCIDR: $POD_CIDR
rotateCertificates: false
serverTLSBootstrap: false
YAML
"$BIN_DIR/kubelet" --config=/var/lib/kubelet/config.yaml --kubeconfig="$KUBECONFIG_VM" \
  --hostname-override="$NODE_NAME" --node-ip="$LAB_IP" --cloud-provider=external \
  --root-dir=/var/lib/kubelet --cert-dir=/var/lib/kubelet/pki --v=2 \
  >"$R/log/kubelet.log" 2>&1 &
echo $! >/run/kubelet.pid
say "kubelet started"
touch "$R/guest-ready"

# ---- command loop (./lab exec) ------------------------------------------------------------------
while [ ! -e "$R/stop" ]; do
  for f in "$R"/cmd/*.sh; do
    [ -e "$f" ] || continue
    b=${f%.sh}
    mv "$f" "$b.run" 2>/dev/null || continue
    ( bash "$b.run" >"$b.out" 2>&1; echo $? >"$b.rc.tmp"; mv "$b.rc.tmp" "$b.rc" ) &
  done
  sleep 0.3
done
say "stop requested"
kill "$(cat /run/kubelet.pid)" 2>/dev/null
sleep 2
kill "$(cat /run/containerd.pid)" 2>/dev/null
say "guest end"
