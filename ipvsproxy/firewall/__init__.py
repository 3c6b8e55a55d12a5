"""The firewall beside IPVS: what IPVS alone does not do (masquerade, source ranges, the VIP
port filter, FORWARD), as constant iptables rules matching ipsets.

Modules: `host_firewall` (`Firewall`: observe, plan, apply, clean up on the host), `rules` (the
constant IPVSPROXY-* chains), `sets` (the sets and their wanted entries), `set_index`
(`SetIndex`: the entries kept per virtual server between full passes), `ipset` (ipset's text
formats), `set_reader` and `set_writer` (the sets over netfilter netlink), `conntrack` (stale
UDP flows), `kube_proxy` (kube-proxy's NodePort sets, read when a node moves over). The
iptables text it writes and reads goes through the toolkit of ipvsproxy/iptables/.
"""
