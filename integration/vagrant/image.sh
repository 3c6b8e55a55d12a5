#!/usr/bin/env bash
# Every node: ipvsproxy's image, built from the synced project by scripts/image (no registry
# publishes it) and imported into the kubelet's containerd, where the DaemonSet's
# `image: localhost/ipvsproxy:VERSION` (imagePullPolicy IfNotPresent) finds it. Idempotent:
# rebuilt and imported again only when the project changed.
set -euo pipefail
version=$(sed -n 's/^version = "\(.*\)"/\1/p' /vagrant/pyproject.toml)
archive=/vagrant/.cache/image/ipvsproxy-$version.oci.tar
stamp=/var/lib/ipvsproxy-image.$(find /vagrant/Containerfile /vagrant/pyproject.toml \
    /vagrant/requirements.lock /vagrant/ipvsproxy -type f -exec sha256sum {} + | sort \
    | sha256sum | cut -c1-16)
if [[ ! -f "$stamp" ]]; then
    /vagrant/scripts/image
    ctr -n k8s.io images import "$archive"
    rm -f /var/lib/ipvsproxy-image.* && touch "$stamp"
fi
