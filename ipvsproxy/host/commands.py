"""How ipvsproxy runs a tool on the host (iptables, ipset, conntrack): `Commands`.

Imports: errors, the standard library.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from ipvsproxy.errors import KernelError, KernelUnavailable

# the Debian package of each tool ipvsproxy runs, for the error when one is missing
_PACKAGES = {"ipset": "ipset", "conntrack": "conntrack", "ip": "iproute2", "nft": "nftables"}


@dataclass(frozen=True, slots=True)
class Commands:
    """Runs host tools, optionally behind a prefix (`ip netns exec NS`)."""

    prefix: tuple[str, ...] = ()
    timeout: float = 60.0

    @property
    def here(self) -> bool:
        """Whether the tools run in this thread's network namespace (no `ip netns exec`
        in the prefix; an `env` that sets their PATH, say, leaves them here)."""
        return self.prefix[:3] != ("ip", "netns", "exec")

    def run(self, args: Sequence[str], *, stdin: str | None = None) -> str:
        argv = [*self.prefix, *args]
        try:
            done = subprocess.run(
                argv, input=stdin, capture_output=True, text=True, timeout=self.timeout
            )
        except FileNotFoundError as exc:
            package = _PACKAGES.get(argv[0], "iptables")
            raise KernelUnavailable(f"{argv[0]} not found: install {package}") from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelError(f"{args[0]}: {exc}") from exc
        if done.returncode:
            detail = done.stderr.strip().replace("\n", "; ") or f"exit status {done.returncode}"
            raise KernelError(f"{args[0]} failed: {detail}")
        return done.stdout
