"""The composition root: wires inputs, the pure core and a kernel into the CLI's commands.

Owns: `diff()` (desired state from manifests, observed state from a saved ipvsadm file,
plan, rendered lines; never changes anything).

Imports: everything below it; never click.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ipvsproxy import api, ipvsadm, manifests
from ipvsproxy.config import Config
from ipvsproxy.errors import ConfigError
from ipvsproxy.model import IpvsState
from ipvsproxy.sync.desired import Desired, desired_state
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.sync.plan import plan
from ipvsproxy.sync.render import Line, describe


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
    return desired_from_objects(manifests.load(paths), config)


def desired_from_objects(
    objects: Iterable[api.RawObject], config: Config
) -> tuple[Desired, api.NodeView]:
    """Parse raw API objects and translate them for this node (`config.node_name`)."""
    parsed = api.parse_objects(objects)
    node = next((n for n in parsed.nodes if n.name == config.node_name), None)
    warnings = list(parsed.warnings)
    if node is None:
        warnings.append(
            f"Node {config.node_name!r} is not in the input: no NodePort virtual servers "
            "(set --hostname-override to the node's name)"
        )
        node = api.NodeView(config.node_name)
    desired = desired_state(parsed.services, parsed.slices, node, config)
    all_warnings = (*warnings, *desired.warnings)
    return Desired(desired.state, desired.origins, all_warnings), node


def read_kernel_state(path: Path) -> IpvsState:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    return ipvsadm.parse_save(text)


def diff(
    config: Config, *, manifest_paths: Sequence[Path], kernel_state: Path | None
) -> DiffResult:
    """The plan `run` would apply, in words; changes nothing."""
    if kernel_state is None:
        raise ConfigError(
            "--kernel-state FILE is required (the live IPVS backend is not built yet)"
        )
    desired, node = desired_from_manifests(manifest_paths, config)
    observed = read_kernel_state(kernel_state)
    ops = plan(
        desired.state,
        observed,
        ownership=ownership_for(config, node.addresses),
        manage_addresses=False,
    )
    lines = tuple(describe(op, desired.origins, observed, config.dummy_device) for op in ops)
    notes = (
        f"addresses on {config.dummy_device} are not compared: {kernel_state} is a saved "
        "ipvsadm table, which does not record them",
    )
    return DiffResult(lines, desired.warnings, notes)
