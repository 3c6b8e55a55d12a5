"""The composition root: wires inputs, the pure core and a kernel into the CLI's commands.

Owns: `diff()` (desired state from manifests, observed state from a saved ipvsadm file or
the live kernel, plan, rendered lines; never changes anything), `sync()` (one pass: observe,
plan, apply) and `run_once()` (prepare the node, one sync of manifests into the live kernel).

Imports: everything below it; never click.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ipvsproxy import api, ipvsadm, manifests
from ipvsproxy.config import Config
from ipvsproxy.errors import ConfigError
from ipvsproxy.model import IpvsState
from ipvsproxy.sync.desired import Desired, from_objects
from ipvsproxy.sync.engine import SyncResult, sync
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.sync.plan import plan
from ipvsproxy.sync.render import Line, describe

if TYPE_CHECKING:
    from ipvsproxy.netlink import NetlinkKernel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DiffResult:
    lines: tuple[Line, ...]
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        """0 in sync, 1 changes pending (errors are exceptions: the CLI maps them to 2)."""
        return 1 if self.lines else 0


def desired_from_manifests(paths: Sequence[Path], config: Config) -> tuple[Desired, api.NodeView]:
    """Parse manifests and translate them for this node."""
    return from_objects(manifests.load(paths), config)


def read_kernel_state(path: Path) -> IpvsState:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    return ipvsadm.parse_save(text)


def diff(
    config: Config, *, manifest_paths: Sequence[Path], kernel_state: Path | None
) -> DiffResult:
    """The plan `run` would apply, in words; changes nothing.

    Observed state comes from `kernel_state` (a saved `ipvsadm-save -n`) or, without it,
    from the live kernel (root on a host with IPVS).
    """
    desired, node = desired_from_manifests(manifest_paths, config)
    notes: tuple[str, ...] = ()
    if kernel_state is not None:
        observed = read_kernel_state(kernel_state)
        notes = (
            f"addresses on {config.dummy_device} are not compared: {kernel_state} is a saved "
            "ipvsadm table, which does not record them",
        )
    else:
        with _live_kernel(config) as kernel:
            observed = kernel.observe()
    ops = plan(
        desired.state,
        observed,
        ownership=ownership_for(config, node.addresses),
        manage_addresses=kernel_state is None,
    )
    lines = tuple(describe(op, desired.origins, observed, config.dummy_device) for op in ops)
    return DiffResult(lines, desired.warnings, notes)


def run_once(config: Config, *, manifest_paths: Sequence[Path]) -> SyncResult:
    """Prepare the node (sysctls, timeouts) and sync the manifests into the live kernel once."""
    from ipvsproxy.netlink import sysctl

    desired, node = desired_from_manifests(manifest_paths, config)
    for warning in desired.warnings:
        log.warning("%s", warning)
    with _live_kernel(config) as kernel:  # first: no IPVS, nothing on the node is touched
        settings = sysctl.required(os.uname().release, strict_arp=config.strict_arp)
        for setting in sysctl.ensure(settings):
            log.info("set %s=%s: %s", setting.name, setting.value, setting.why)
        kernel.set_timeouts(
            tcp=config.tcp_timeout, tcp_fin=config.tcp_fin_timeout, udp=config.udp_timeout
        )
        result = sync(kernel, desired, node, config)
    log.info("sync done: %d operations, %d failed", len(result.plan), len(result.report.failures))
    return result


def _live_kernel(config: Config) -> NetlinkKernel:
    from ipvsproxy.netlink import NetlinkKernel

    return NetlinkKernel(device=config.dummy_device)
