"""`ipvsproxy status`: what this node's proxy does for each Service and why (docs/status.md),
read from the running agent's /status, or computed as `diff` does when none answers.

Imports: click (only in ipvsproxy.cli), agent, status, cli.help, cli.settings, cli.options,
errors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from ipvsproxy import agent, logs
from ipvsproxy.cli.help import HTTP, OWN, Command, SectionArgument, option
from ipvsproxy.cli.options import (
    errors_to_exit,
    kube_proxy_options,
    logging_options,
    node_options,
    source_options,
)
from ipvsproxy.cli.settings import _is_ip, flag, from_config_file, make_config, make_source
from ipvsproxy.config import (
    Config,
    parse_duration,
)
from ipvsproxy.errors import ConfigError, IpvsproxyError
from ipvsproxy.serve import parse_bind_address
from ipvsproxy.traffic import KERNEL_REFRESH


@click.command(cls=Command)
@click.argument("service", cls=SectionArgument, required=False, metavar="[NAMESPACE/NAME[:PORT]]")
@option(
    "--output",
    "-o",
    section=OWN,
    type=click.Choice(["table", "wide", "json"]),
    default="table",
    show_default=True,
    help="table: sized to the terminal; wide: more columns, a line per virtual server with "
    "its drift; json: the document (docs/status.md).",
)
@option("--watch", "-w", section=OWN, is_flag=True,
        help="Refresh every --interval (in place on a terminal, else a block each).")  # fmt: skip
@option("--interval", section=OWN, default="2s", show_default=True, metavar="DURATION",
        help="Time between two refreshes of --watch (also the window of its rates).")  # fmt: skip
@option(
    "--agent",
    "agent_address",
    section=OWN,
    metavar="URL",
    help="The running agent (default: http:// and --metrics-bind-address, or --config's "
    "metricsBindAddress).",
)
@option(
    "--metrics-bind-address",
    section=HTTP,
    default="127.0.0.1:10249",
    show_default=True,
    metavar="ADDR[:PORT]",
    help="The agent's metrics address, where it answers /status.",
)
@option(
    "--kernel-state",
    section=OWN,
    type=click.Path(path_type=Path),
    help="Without an agent: the kernel's table from a file of `ipvsadm-save -n` (no counters) "
    "instead of the live kernel.",
)
@source_options
@node_options
@kube_proxy_options
@logging_options
@errors_to_exit
def status(
    service: str | None,
    output: str,
    watch: bool,
    interval: str,
    agent_address: str | None,
    kernel_state: Path | None,
    **opts: Any,
) -> None:
    """Each Service port on this node: its virtual servers, its endpoints (weight,
    connections, rates) and why an endpoint is not programmed here; drift and pass times.

    Reads the running agent's /status; when no agent answers and --kubeconfig or --manifests
    is given, computes the same from the API (or the files) and the kernel, as `diff` does.
    Exit status: 0 in sync, 1 drift, 2 error.
    """
    from ipvsproxy.status.document import Selector

    from_config_file(opts)
    selector = Selector.parse(service) if service else None
    seconds = parse_duration(interval, option="--interval")
    if seconds <= 0:
        raise ConfigError("--interval: must be positive")
    given_source = any(opts[name] for name in ("manifest_paths", "kubeconfig", "master", "context"))
    source = make_source(opts)
    address = opts.pop("metrics_bind_address")
    config = make_config(opts)
    url = agent_address or _agent_url(address)
    try:
        with ExitStack() as stack:
            read = _status_reader(stack, config, url, source, given_source, kernel_state, selector)
            _show_status(read, selector, output=output, watch=watch, interval=seconds)
    except KeyboardInterrupt:  # Ctrl-C ends --watch (or a slow read) quietly
        sys.exit(0)


def _agent_url(address: str) -> str:
    from ipvsproxy.status.client import agent_url

    text = address if not _is_ip(address) else (
        f"[{address}]:10249" if ":" in address else f"{address}:10249"
    )  # fmt: skip
    host, port = parse_bind_address(
        text, option=flag("metrics_bind_address", "--metrics-bind-address")
    )
    return agent_url(host, port)


StatusReader = Callable[[Any], dict[str, Any]]


def _status_reader(
    stack: ExitStack,
    config: Config,
    url: str,
    source: agent.Source,
    given_source: bool,
    kernel_state: Path | None,
    selector: Any,
) -> StatusReader:
    """The agent's /status when one answers; else, with a source, the local computation
    (said on stderr); else exit 2."""
    from ipvsproxy.status.client import AgentUnreachable, fetch

    if kernel_state is None:
        try:
            fetch(url, selector, timeout=5.0)
            return lambda selector: fetch(url, selector)
        except AgentUnreachable as exc:
            if not given_source:
                raise IpvsproxyError(
                    f"{exc}; give --kubeconfig or --manifests to compute the status without it"
                ) from exc
            click.echo(
                f"ipvsproxy: no agent at {url}: computing from {agent.describe_source(source)} "
                "and the kernel",
                err=True,
            )
    elif not given_source:
        raise ConfigError("--kernel-state needs --kubeconfig or --manifests")
    local = stack.enter_context(agent.LocalStatus(config, source=source, kernel_state=kernel_state))
    return local.document


def _show_status(
    read: StatusReader, selector: Any, *, output: str, watch: bool, interval: float
) -> None:
    """One document (exit 0 in sync, 1 drift; 2 when the Service selected is not there), or
    --watch's frames until Ctrl-C. A one-shot
    document without rates (the agent's first sample) is read again once the kernel has
    refreshed its counters (traffic.KERNEL_REFRESH, 2 s)."""
    import time

    from ipvsproxy.status.document import exit_code

    out = sys.stdout
    if not watch:
        doc = read(selector)
        if selector is not None and not doc["services"]:  # a typo must not read "in sync"
            port = f" with a port {selector.port!r}" if selector.port else ""
            raise IpvsproxyError(f"no Service {selector.namespace}/{selector.name}{port}")
        if doc["rateWindowSeconds"] is None and _has_counters(doc):
            time.sleep(KERNEL_REFRESH)
            doc = read(selector)
        out.write(_status_text(doc, output, compact=False))
        out.flush()
        sys.exit(exit_code(doc))
    tty = out.isatty()
    while True:
        try:
            text = _status_text(read(selector), output, compact=True)
        except IpvsproxyError as exc:  # the agent restarting: said, and tried again
            text = f"ipvsproxy: error: {logs.escape(str(exc))}\n"
        out.write("\x1b[H\x1b[2J" + text if tty else text + ("" if output == "json" else "\n"))
        out.flush()
        time.sleep(interval)


def _has_counters(doc: dict[str, Any]) -> bool:
    return any(vs["traffic"] is not None for s in doc["services"] for vs in s["virtualServers"])


def _status_text(doc: dict[str, Any], output: str, *, compact: bool) -> str:
    import json
    import shutil

    from ipvsproxy.status.table import render

    if output == "json":
        return json.dumps(doc) + "\n" if compact else json.dumps(doc, indent=2) + "\n"
    wide = output == "wide"
    if wide and not sys.stdout.isatty():
        width = sys.maxsize  # piped or saved: -o wide means every column whole, nothing cut
    else:
        width = shutil.get_terminal_size((100, 24)).columns
    return render(doc, width=width, wide=wide)
