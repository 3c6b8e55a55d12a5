#!/usr/bin/env bash
# The control plane: kubeadm init as an operator runs it, kube-proxy included (its mode from
# KUBE_PROXY_MODE: ipvs, iptables or nftables), and a CNI. ipvsproxy then takes the nodes over
# from kube-proxy by docs/migration.md (takeover.sh). Idempotent.
set -euo pipefail
: "${NODE_IP:?}" "${KUBEADM_TOKEN:?}" "${POD_CIDR:?}" "${SERVICE_CIDR:?}" "${KUBE_PROXY_MODE:?}"
export KUBECONFIG=/etc/kubernetes/admin.conf

case "$KUBE_PROXY_MODE" in
    ipvs|nftables) mode=$KUBE_PROXY_MODE ;;
    iptables) mode="" ;;  # kubeadm's default: an empty mode is iptables on Linux
    *) echo "KUBE_PROXY_MODE: ipvs, iptables or nftables, not '$KUBE_PROXY_MODE'" >&2; exit 2 ;;
esac

if [[ ! -f /etc/kubernetes/admin.conf ]]; then
    cat > /root/kubeadm.yaml <<YAML
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
bootstrapTokens: [{token: "$KUBEADM_TOKEN", ttl: "0s"}]
localAPIEndpoint: {advertiseAddress: "$NODE_IP"}
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
controlPlaneEndpoint: "$NODE_IP:6443"
networking: {podSubnet: "$POD_CIDR", serviceSubnet: "$SERVICE_CIDR"}
---
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: "$mode"
YAML
    kubeadm init --config /root/kubeadm.yaml
fi

install -d -o vagrant -g vagrant /home/vagrant/.kube
install -m 0600 -o vagrant -g vagrant /etc/kubernetes/admin.conf /home/vagrant/.kube/config

# CNI: flannel (its pods reach the API through the kubernetes Service: kube-proxy serves it
# first, ipvsproxy after the takeover)
if ! kubectl get namespace kube-flannel > /dev/null 2>&1; then
    curl -fsSL https://github.com/flannel-io/flannel/releases/latest/download/kube-flannel.yml \
        | sed "s#10.244.0.0/16#$POD_CIDR#" | kubectl apply -f -
fi
