#!/usr/bin/env bash
# The documented takeover on this cluster, run on the control plane once every node has joined:
# docs/migration.md's steps 1 and 2 once, then its step 3 for every node not yet moved, their
# shell blocks taken from the page as written (integration/docblocks.py, the same extraction the
# tests use), with NODE set to each node in turn. Idempotent: a moved node (labelled) is skipped,
# and steps 1 and 2 are a patch and an apply.
set -euo pipefail
export KUBECONFIG=/etc/kubernetes/admin.conf
cd /vagrant  # the page's paths (deploy/...) are the checkout's
doc() { python3 integration/docblocks.py docs/migration.md "$1"; }

kubectl wait node --all --for=condition=Ready --timeout=15m
kubectl -n kube-system rollout status daemonset/kube-proxy --timeout=10m
bash -euo pipefail -c "$(doc '## 1.')"
bash -euo pipefail -c "$(doc '## 2.')"
step3=$(doc '## 3.' | sed '/^NODE=/d')  # the page's example node; each node's name below
for node in $(kubectl get nodes -o jsonpath='{.items[*].metadata.name}'); do
    label=$(kubectl get node "$node" -o jsonpath='{.metadata.labels.ipvsproxy\.io/proxy}')
    if [[ "$label" == ipvsproxy ]]; then
        echo "takeover: $node has moved already"
        continue
    fi
    echo "takeover: moving $node (docs/migration.md, step 3)"
    NODE=$node bash -euo pipefail -c "$step3"
done
kubectl -n kube-system get pods -o wide -l 'k8s-app=kube-proxy' 2>&1
kubectl -n kube-system get pods -o wide -l 'app.kubernetes.io/name=ipvsproxy'
