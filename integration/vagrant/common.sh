#!/usr/bin/env bash
# Every node: container runtime, kubeadm/kubelet/kubectl, the kernel bits a proxy needs.
# Idempotent: each step checks before it changes anything.
set -euo pipefail
: "${NODE_IP:?}" "${K8S_VERSION:?}"
export DEBIAN_FRONTEND=noninteractive

if ! dpkg-query -W -f='${Status}' containerd 2>/dev/null | grep -q "ok installed"; then
    apt-get update -qq
    apt-get install -y -qq apt-transport-https ca-certificates curl gpg containerd \
        ipvsadm ipset iptables conntrack python3-venv
fi

modules=(overlay br_netfilter ip_vs ip_vs_rr ip_vs_wrr ip_vs_sh dummy)
printf '%s\n' "${modules[@]}" > /etc/modules-load.d/ipvsproxy-cluster.conf
for module in "${modules[@]}"; do modprobe "$module"; done

cat > /etc/sysctl.d/90-ipvsproxy-cluster.conf <<SYSCTL
net.bridge.bridge-nf-call-iptables = 1
net.bridge.bridge-nf-call-ip6tables = 1
net.ipv4.ip_forward = 1
SYSCTL
sysctl -q --system

if swapon --show | grep -q .; then
    swapoff -a
    sed -i '/\sswap\s/s/^/#/' /etc/fstab
fi

if [[ ! -f /etc/containerd/config.toml ]] || ! grep -q 'SystemdCgroup = true' /etc/containerd/config.toml; then
    mkdir -p /etc/containerd
    containerd config default | sed 's/SystemdCgroup = false/SystemdCgroup = true/' \
        > /etc/containerd/config.toml
    systemctl restart containerd
fi

keyring=/etc/apt/keyrings/kubernetes-apt-keyring.gpg
list=/etc/apt/sources.list.d/kubernetes.list
repo="https://pkgs.k8s.io/core:/stable:/${K8S_VERSION}/deb/"
if [[ ! -f "$keyring" ]] || ! grep -qF "$repo" "$list" 2>/dev/null; then
    mkdir -p /etc/apt/keyrings
    curl -fsSL "${repo}Release.key" | gpg --dearmor --yes -o "$keyring"
    echo "deb [signed-by=$keyring] $repo /" > "$list"
    apt-get update -qq
fi
if ! command -v kubeadm > /dev/null; then
    apt-get install -y -qq kubelet kubeadm kubectl
    apt-mark hold kubelet kubeadm kubectl
fi

# the kubelet must advertise the private-network address, not the NAT one of the provider
if ! grep -qs -- "--node-ip=$NODE_IP" /etc/default/kubelet; then
    echo "KUBELET_EXTRA_ARGS=--node-ip=$NODE_IP" > /etc/default/kubelet
    systemctl restart kubelet || true
fi
