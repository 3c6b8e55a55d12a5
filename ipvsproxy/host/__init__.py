"""The host around the kernel's tables: its settings under /proc (sysctls, conntrack's
limits and timeouts) and the processes run on it (`Commands`: iptables, ipset, conntrack,
optionally behind a prefix such as `ip netns exec NS`).

Imports: config, errors, the standard library.
"""
