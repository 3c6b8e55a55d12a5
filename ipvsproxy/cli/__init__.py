"""The command line: parse options into a `Config`, call the agent, map errors to exit codes.

Exit codes are API: `diff` exits 0 in sync, 1 with changes pending, 2 on any error (with a
one-line message, never a traceback). `run` exits 0 when every operation was applied, 1 when
some failed, 2 on bad input, 3 when it cannot start (no usable kernel backend), 4 when IPVS
is not usable and `--no-fallback` forbids the iptables fallback, 5 when IPVS is usable but
a tool of its firewall rules is missing (and `--allow-no-firewall-rules` was not given).

Imports: click (only here), config, agent, logs, errors.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import click

from ipvsproxy import __version__, agent, logs
from ipvsproxy.cli.help import KUBE_PROXY, OWN, Group, SectionOption, kube_proxy_flag, option
from ipvsproxy.cli.options import (
    EXIT_FAILED_OPS,
    conntrack_options,
    duration,
    errors_to_exit,
    http_options,
    ignored_flag_options,
    kube_proxy_options,
    log_format_option,
    log_level_option,
    logging_options,
    node_options,
    once_options,
    ownership_options,
    source_options,
)
from ipvsproxy.cli.settings import (
    apply_logging,
    conntrack_config,
    flag,
    from_config_file,
    make_config,
    make_source,
    ownership_config,
    run_config,
)
from ipvsproxy.cli.status_command import status
from ipvsproxy.config import Config, parse_scheduler
from ipvsproxy.errors import ConfigError, IpvsproxyError
from ipvsproxy.serve import parse_bind_address
from ipvsproxy.sync.render import render_text, to_json


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ipvsproxy", cls=SectionOption, section=OWN)
@log_level_option()
@log_format_option(" Given after the command too, these win there.")
def main(log_level: str, log_format: str) -> None:
    """ipvsproxy: Kubernetes Service VIPs with the kernel's IPVS load balancer."""
    logs.configure(log_level, log_format)


@main.command()
@source_options
@option(
    "--kernel-state",
    section=OWN,
    type=click.Path(path_type=Path),
    help="Observed IPVS table: a file with the output of `ipvsadm-save -n` "
    "(default: read the live kernel; needs root and IPVS).",
)
@option(
    "--output",
    "-o",
    section=OWN,
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text: ipvsadm-like lines with the Service each one is for; json: one document "
    "with the operations, a summary and the warnings.",
)
@node_options
@kube_proxy_options
@logging_options
@errors_to_exit
def diff(kernel_state: Path | None, output: str, **opts: Any) -> None:
    """Dry run: print the plan `run` would apply; change nothing.

    Exit status: 0 in sync, 1 changes pending, 2 error.
    """
    from_config_file(opts)
    source = make_source(opts)
    config = make_config(opts)
    try:
        result = agent.diff(config, source=source, kernel_state=kernel_state)
    except IpvsproxyError:
        raise
    except Exception as exc:  # a bug: Python's exit status 1 would read "changes pending"
        traceback.print_exc()
        raise IpvsproxyError(f"internal error (a bug; the traceback is above): {exc!r}") from exc
    for warning in result.warnings:
        click.echo(f"warning: {logs.escape(warning)}", err=True)
    if output == "json":
        doc = to_json(
            result.lines, warnings=result.warnings, notes=result.notes, repairs=result.repairs
        )
        click.echo(doc, nl=False)
    else:
        click.echo(render_text(result.lines, notes=result.notes, repairs=result.repairs), nl=False)
    sys.exit(result.exit_code)


@main.command()
@source_options
@once_options
@duration(
    "--min-sync-period",
    "1s",
    "At most one sync per this (e.g. 1s, 500ms).",
    "--ipvs-min-sync-period",
    "min_sync_period",
)
@duration(
    "--sync-period",
    "30s",
    "At least one full resync per this.",
    "--ipvs-sync-period",
    "sync_period",
)
@option(
    "--drain-timeout",
    section=OWN,
    default="30s",
    show_default=True,
    metavar="DURATION",
    help="How long a removed endpoint keeps its connections (0: until they end, as kube-proxy).",
)
@option(
    "--slow-start",
    section=OWN,
    default="0s",
    show_default=True,
    metavar="DURATION",
    help="Ramp a newly serving endpoint's weight from 1 to full over this (at most 1h; 0: "
    "off). The annotation ipvsproxy.io/slow-start overrides it per Service.",
)
@kube_proxy_flag("--strict-arp", "--ipvs-strict-arp", "strict_arp",
                 help="Set arp_ignore=1 and arp_announce=2.")  # fmt: skip
@duration("--tcp-timeout", "0s", "IPVS TCP timeout (0: leave the kernel's).",
          "--ipvs-tcp-timeout", "tcp_timeout")  # fmt: skip
@duration("--tcp-fin-timeout", "0s", "IPVS TCP FIN_WAIT timeout (0: leave the kernel's).",
          "--ipvs-tcpfin-timeout", "tcp_fin_timeout")  # fmt: skip
@duration("--udp-timeout", "0s", "IPVS UDP timeout (0: leave the kernel's).",
          "--ipvs-udp-timeout", "udp_timeout")  # fmt: skip
@conntrack_options
@node_options
@kube_proxy_options
@ignored_flag_options
@http_options
@logging_options
@errors_to_exit
def run(once: bool, cleanup: bool, init_only: bool, **opts: Any) -> None:
    """Program the kernel's IPVS table from Services and EndpointSlices.

    Watches the Kubernetes API (--kubeconfig, else in-cluster, else ~/.kube/config), or
    reads --manifests and re-reads them when they change. Stops on SIGTERM/SIGINT, leaving
    the rules in place; SIGHUP makes the next pass a full resync. Exit status: 0 stopped
    (or, with --once, all applied), 1 some operations failed (--once), 2 bad input or the
    API refused us, 3 no usable backend, 4 no IPVS and --no-fallback, 5 IPVS without a tool
    its firewall rules need.
    """
    from_config_file(opts)
    if opts.pop("write_config_to"):
        raise ConfigError(
            "--write-config-to: ipvsproxy writes no configuration file (use kube-proxy's, "
            "or kubeadm's kube-proxy ConfigMap, with --config)"
        )
    source = make_source(opts)
    config = run_config(opts)
    if cleanup or init_only:
        lines = (
            cleanup_lines(agent.cleanup(config, dry_run=False), dry_run=False, whose="ipvsproxy's")
            if cleanup
            else agent.prepare_host(config)
        )
        for line in lines:
            click.echo(line)
        return
    if once:
        if not isinstance(source, agent.Manifests):
            raise ConfigError("--once needs --manifests (the API source is long-running)")
        outcome = agent.run_once(config, manifest_paths=source.paths)
        result = outcome.sync
        click.echo(
            f"applied {result.report.applied} of {len(result.plan)} operations"
            + (f", {len(result.report.failures)} failed" if result.report.failures else "")
            + (f"; {outcome.firewall_changes} firewall changes" if outcome.firewall_changes else "")
        )
        for failure in result.report.failures:
            click.echo(f"failed: {logs.escape(str(failure.error))}", err=True)
        if outcome.firewall_error:
            click.echo(
                f"failed: firewall rules: {logs.escape(str(outcome.firewall_error))}", err=True
            )
        sys.exit(0 if outcome.ok else EXIT_FAILED_OPS)
    agent.run(config, source=source)


def cleanup_lines(removed: list[str], *, dry_run: bool, whose: str) -> list[str]:
    verb = "would remove" if dry_run else "removed"
    summary = f"{verb} {len(removed)} objects" if removed else f"nothing of {whose} found"
    return [*(f"{verb}: {item}" for item in removed), summary]


@main.command()
@option("--dry-run", section=OWN, is_flag=True,
        help="List what would be removed; change nothing.")  # fmt: skip
@option(
    "--kube-proxy",
    "kube_proxy",
    section=OWN,
    is_flag=True,
    help="Remove what kube-proxy left instead, in any mode: its KUBE-* chains and jumps "
    "(IPVS and iptables modes), its ipsets (IPVS mode), its `kube-proxy` nftables tables "
    "(nftables mode); the IPVS table and kube-ipvs0 stay for ipvsproxy to take over in place.",
)
@option(
    "--including-ipvs",
    section=OWN,
    is_flag=True,
    help="With --kube-proxy: also its virtual servers (the ownership rule) and kube-ipvs0.",
)
@option(
    "--keep-ipvs",
    section=OWN,
    is_flag=True,
    help="Remove only ipvsproxy's iptables rules and ipsets; its virtual servers and the dummy "
    "device stay, for kube-proxy's IPVS mode to take over in place (the way back from a "
    "migration: docs/migration.md).",
)
@option(
    "--force",
    section=OWN,
    is_flag=True,
    help="Remove ipvsproxy's objects even while an agent runs on this node (it writes them "
    "again on its next pass), or kube-proxy's before this node's agent is ready; without "
    "it, cleanup refuses then (exit 2).",
)
@option(
    "--healthz-bind-address",
    section=OWN,
    default="0.0.0.0:10256",
    show_default=True,
    metavar="ADDR:PORT",
    help="With --kube-proxy: where this node's agent serves /readyz (its own "
    "--healthz-bind-address); kube-proxy's rules are removed only once it answers 200.",
)
@ownership_options
@logging_options
@errors_to_exit
def cleanup(
    dry_run: bool,
    kube_proxy: bool,
    including_ipvs: bool,
    keep_ipvs: bool,
    force: bool,
    healthz_bind_address: str,
    **opts: Any,
) -> None:
    """Remove everything ipvsproxy owns, in both backends, and nothing else.

    IPVS: its virtual servers (the ownership rule: VIPs on the dummy device, --service-cidr,
    NodePorts on this host's addresses), the VIPs and the dummy device. iptables: its
    chains (IPVSPX-*) and the jumps into them. With --kube-proxy: kube-proxy's leftovers
    instead; the migration (docs/migration.md) uses both. While an ipvsproxy agent runs in
    this network namespace, cleanup of ipvsproxy's own objects refuses (exit 2, naming it)
    unless --force; --dry-run and --kube-proxy run beside it. --kube-proxy refuses (exit 2,
    naming what the agent waits for) until this node's agent answers /readyz, unless
    --force. Exit status: 0 done, 2 error.
    """
    apply_logging(opts)
    if including_ipvs and not kube_proxy:
        raise ConfigError("--including-ipvs goes with --kube-proxy")
    if keep_ipvs and kube_proxy:
        raise ConfigError("--keep-ipvs is for ipvsproxy's own rules, not with --kube-proxy")
    healthz = parse_bind_address(healthz_bind_address, option="--healthz-bind-address")
    config = Config(**ownership_config(opts), healthz_bind_address=healthz)
    if kube_proxy:
        removed = agent.cleanup_kube_proxy(
            config, dry_run=dry_run, ipvs=including_ipvs, force=force
        )
        whose = "kube-proxy's"
    else:
        removed = agent.cleanup(config, dry_run=dry_run, ipvs=not keep_ipvs, force=force)
        whose = "ipvsproxy's"
    for line in cleanup_lines(removed, dry_run=dry_run, whose=whose):
        click.echo(line)


@main.command()
@option(
    "--config",
    "config_file",
    section=KUBE_PROXY,
    type=click.Path(path_type=Path),
    help="A KubeProxyConfiguration file (the one `run --config` reads): its ipvs.scheduler, "
    "ipvs.strictARP, conntrack.* and logging; flags given on the command line win over it.",
)
@option(
    "--scheduler",
    "--ipvs-scheduler",
    "scheduler",
    section=KUBE_PROXY,
    default="rr",
    show_default=True,
    help="The node-wide default scheduler, whose module is loaded.",
)
@kube_proxy_flag("--strict-arp", "--ipvs-strict-arp", "strict_arp",
                 help="Set arp_ignore=1 and arp_announce=2.")  # fmt: skip
@conntrack_options
@logging_options
@errors_to_exit
def prepare(**opts: Any) -> None:
    """Load the IPVS modules and set the kernel settings ipvsproxy needs, then exit.

    For a privileged init container, so that the agent itself runs with two capabilities
    (NET_ADMIN, NET_RAW) and a read-only /proc/sys. `run` checks the same settings at start.
    Exit 0, or 3 when a setting cannot be written (the conntrack ones, `--conntrack-*`, only
    warn, as in `run`).
    """
    from_config_file(opts, warn=False)
    config = Config(
        scheduler=parse_scheduler(opts.pop("scheduler"), option=flag("scheduler", "--scheduler")),
        strict_arp=opts.pop("strict_arp"),
        **conntrack_config(opts),
    )
    for line in agent.prepare_host(config):
        click.echo(line)


main.add_command(status)
