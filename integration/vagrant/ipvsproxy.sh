#!/usr/bin/env bash
# ipvsproxy on this node from the synced project folder, as a systemd unit in place of
# kube-proxy. Idempotent: reinstalled and restarted only when the project or unit changed.
set -euo pipefail
: "${NODE_IP:?}" "${SERVICE_CIDR:?}"
venv=/opt/ipvsproxy
unit=/etc/systemd/system/ipvsproxy.service

[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
stamp="$venv/.source-$(find /vagrant/pyproject.toml /vagrant/ipvsproxy -type f -name '*.*' \
    -exec sha256sum {} + | sort | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    "$venv/bin/pip" install --quiet --upgrade /vagrant
    rm -f "$venv"/.source-* && touch "$stamp"
    changed=1
fi

new_unit=$(cat <<UNIT
[Unit]
Description=ipvsproxy: Kubernetes Service VIPs with IPVS (in place of kube-proxy)
After=network-online.target kubelet.service
Wants=network-online.target

[Service]
ExecStartPre=$venv/bin/ipvsproxy prepare
ExecStart=$venv/bin/ipvsproxy --log-format json run \\
    --kubeconfig /etc/kubernetes/kubelet.conf \\
    --hostname-override $(hostname) \\
    --service-cidr $SERVICE_CIDR \\
    --nodeport-addresses $NODE_IP/32 \\
    --metrics-bind-address 0.0.0.0:10249 \\
    --healthz-bind-address 0.0.0.0:10256
Restart=always
RestartSec=2

[Install]
WantedBy=multi-user.target
UNIT
)
if [[ "$(cat "$unit" 2>/dev/null)" != "$new_unit" ]]; then
    printf '%s\n' "$new_unit" > "$unit"
    systemctl daemon-reload
    changed=1
fi
systemctl enable --quiet ipvsproxy
if [[ -n "${changed:-}" ]] || ! systemctl is-active --quiet ipvsproxy; then
    systemctl restart ipvsproxy
fi
