#!/usr/bin/env bash
# A worker: join the control plane. Idempotent (a joined node is left alone).
set -euo pipefail
: "${CONTROL_PLANE_IP:?}" "${KUBEADM_TOKEN:?}"

if [[ ! -f /etc/kubernetes/kubelet.conf ]]; then
    # a throw-away test cluster on a private network: the CA is not pinned
    kubeadm join "$CONTROL_PLANE_IP:6443" --token "$KUBEADM_TOKEN" \
        --discovery-token-unsafe-skip-ca-verification
fi
