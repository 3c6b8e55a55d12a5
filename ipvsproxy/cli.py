"""The command line: parse options into a `Config`, call the agent, map errors to exit codes.

Exit codes are API: `diff` exits 0 in sync, 1 with changes pending, 2 on any error (with a
one-line message, never a traceback). `run` exits 0 when every operation was applied, 1 when
some failed, 2 on bad input, 3 when it cannot start (no usable kernel backend).

Imports: click (only here), config, agent, errors.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ipvsproxy import __version__, agent
from ipvsproxy.config import Config, parse_cidrs, parse_port_range, parse_scheduler
from ipvsproxy.errors import ConfigError, IpvsproxyError, KernelUnavailable
from ipvsproxy.sync.render import render_text, to_json

EXIT_FAILED_OPS = 1
EXIT_ERROR = 2
EXIT_STARTUP_FAILURE = 3
log = logging.getLogger("ipvsproxy")

F = TypeVar("F", bound=Callable[..., Any])


manifests_option = click.option(
    "--manifests",
    "manifest_paths",
    multiple=True,
    required=True,
    type=click.Path(path_type=Path),
    help="YAML/JSON files or directories with Services, EndpointSlices and Nodes (repeatable).",
)


def node_options(func: F) -> F:
    """Options shared by every command that computes desired state for this node."""
    options = [
        click.option(
            "--hostname-override",
            metavar="NAME",
            help="This node's name: which endpoints are local (default: the host name).",
        ),
        click.option(
            "--nodeport-addresses",
            metavar="CIDR,...",
            default="",
            help="Node addresses NodePorts listen on (default: all of the node's addresses).",
        ),
        click.option(
            "--scheduler",
            default="rr",
            show_default=True,
            help="Node-wide default IPVS scheduler (a Service may override it by annotation).",
        ),
        click.option(
            "--service-cidr",
            metavar="CIDR,...",
            default="",
            help="Service VIP ranges: virtual servers there are ipvsproxy's (see Ownership).",
        ),
        click.option(
            "--ipvs-exclude-cidrs",
            metavar="CIDR,...",
            default="",
            help="Virtual servers in these ranges are never changed or deleted.",
        ),
        click.option(
            "--service-node-port-range",
            default="30000-32767",
            show_default=True,
            help="The cluster's NodePort range (ownership of node-address virtual servers).",
        ),
        click.option(
            "--dummy-device",
            default="kube-ipvs0",
            show_default=True,
            help="The dummy device that holds the VIPs.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_config(opts: dict[str, Any]) -> Config:
    """Build and validate the Config from parsed option values."""
    node_name = opts.get("hostname_override")
    return Config(
        **({"node_name": node_name} if node_name else {}),
        scheduler=parse_scheduler(opts["scheduler"], option="--scheduler"),
        nodeport_cidrs=parse_cidrs(opts["nodeport_addresses"], option="--nodeport-addresses"),
        service_cidrs=parse_cidrs(opts["service_cidr"], option="--service-cidr"),
        exclude_cidrs=parse_cidrs(opts["ipvs_exclude_cidrs"], option="--ipvs-exclude-cidrs"),
        nodeport_range=parse_port_range(
            opts["service_node_port_range"], option="--service-node-port-range"
        ),
        dummy_device=opts["dummy_device"],
    )


def errors_to_exit(func: F) -> F:
    """Our errors become one line on stderr and exit status 2; never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KernelUnavailable as exc:
            click.echo(f"ipvsproxy: error: {exc}", err=True)
            sys.exit(EXIT_STARTUP_FAILURE if func.__name__ == "run" else EXIT_ERROR)
        except IpvsproxyError as exc:
            click.echo(f"ipvsproxy: error: {exc}", err=True)
            sys.exit(EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ipvsproxy")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
def main(log_level: str) -> None:
    """ipvsproxy: Kubernetes Service VIPs with the kernel's IPVS load balancer."""
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(levelname)s %(message)s"
    )


@main.command()
@manifests_option
@click.option(
    "--kernel-state",
    type=click.Path(path_type=Path),
    help="Observed IPVS table: a file with the output of `ipvsadm-save -n` "
    "(default: read the live kernel; needs root and IPVS).",
)
@click.option("--output", "-o", type=click.Choice(["text", "json"]), default="text")
@node_options
@errors_to_exit
def diff(
    manifest_paths: tuple[Path, ...], kernel_state: Path | None, output: str, **opts: Any
) -> None:
    """Dry run: print the plan `run` would apply; change nothing.

    Exit status: 0 in sync, 1 changes pending, 2 error.
    """
    config = make_config(opts)
    result = agent.diff(config, manifest_paths=manifest_paths, kernel_state=kernel_state)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    if output == "json":
        click.echo(to_json(result.lines, warnings=result.warnings, notes=result.notes), nl=False)
    else:
        click.echo(render_text(result.lines, notes=result.notes), nl=False)
    sys.exit(result.exit_code)


@main.command()
@manifests_option
@click.option("--once", is_flag=True, help="Sync once, then exit (0: all applied, 1: failures).")
@click.option("--strict-arp", is_flag=True, help="Set arp_ignore=1 and arp_announce=2.")
@click.option("--tcp-timeout", type=click.IntRange(min=0), default=0, help="IPVS TCP timeout, s.")
@click.option("--tcp-fin-timeout", type=click.IntRange(min=0), default=0, help="... TCP FIN, s.")
@click.option("--udp-timeout", type=click.IntRange(min=0), default=0, help="IPVS UDP timeout, s.")
@node_options
@errors_to_exit
def run(manifest_paths: tuple[Path, ...], once: bool, **opts: Any) -> None:
    """Program the kernel's IPVS table from Services and EndpointSlices."""
    if not once:
        raise ConfigError(
            "only --once is available in this version: the long-running loop and the "
            "Kubernetes API source (--kubeconfig) are not implemented yet"
        )
    timing = {
        k: opts.pop(k) for k in ("strict_arp", "tcp_timeout", "tcp_fin_timeout", "udp_timeout")
    }
    config = dataclasses.replace(make_config(opts), **timing)
    result = agent.run_once(config, manifest_paths=manifest_paths)
    click.echo(
        f"applied {result.report.applied} of {len(result.plan)} operations"
        + (f", {len(result.report.failures)} failed" if result.report.failures else "")
    )
    for failure in result.report.failures:
        click.echo(f"failed: {failure.error}", err=True)
    sys.exit(EXIT_FAILED_OPS if result.report.failures else 0)
