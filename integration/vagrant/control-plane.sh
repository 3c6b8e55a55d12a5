#!/usr/bin/env bash
# The control plane: kubeadm init WITHOUT the kube-proxy add-on, a CNI, and the RBAC ipvsproxy
# needs. Idempotent.
set -euo pipefail
: "${NODE_IP:?}" "${KUBEADM_TOKEN:?}" "${POD_CIDR:?}" "${SERVICE_CIDR:?}"
export KUBECONFIG=/etc/kubernetes/admin.conf

if [[ ! -f /etc/kubernetes/admin.conf ]]; then
    kubeadm init \
        --apiserver-advertise-address "$NODE_IP" \
        --pod-network-cidr "$POD_CIDR" \
        --service-cidr "$SERVICE_CIDR" \
        --token "$KUBEADM_TOKEN" --token-ttl 0 \
        --skip-phases addon/kube-proxy
fi

install -d -o vagrant -g vagrant /home/vagrant/.kube
install -m 0600 -o vagrant -g vagrant /etc/kubernetes/admin.conf /home/vagrant/.kube/config

# ipvsproxy's least-privilege role, from the project's deployment manifests
kubectl apply -f /vagrant/deploy/base/objects/namespace.yaml -f /vagrant/deploy/base/objects/rbac.yaml
# Here ipvsproxy runs as a systemd unit with each node's own kubelet credentials (no image
# registry in this throw-away cluster): nodes get ipvsproxy's role too.
kubectl apply -f - <<YAML
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: ipvsproxy-nodes}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: ipvsproxy}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}]
YAML

# CNI: flannel (its pods reach the API through the kubernetes Service: ipvsproxy serves it)
if ! kubectl get namespace kube-flannel > /dev/null 2>&1; then
    curl -fsSL https://github.com/flannel-io/flannel/releases/latest/download/kube-flannel.yml \
        | sed "s#10.244.0.0/16#$POD_CIDR#" | kubectl apply -f -
fi
