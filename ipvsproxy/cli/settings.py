"""How the command line's values become what the commands run with: a `Config` (with
`--config`'s kube-proxy file read first, its fields named in errors), the object source, the
logging settings.

Imports: click (only in ipvsproxy.cli), agent, config, kpconfig, logs, errors, model, serve,
sync.slowstart.
"""

from __future__ import annotations

import dataclasses
import logging
from ipaddress import ip_address
from typing import Any

import click
from click.core import ParameterSource

from ipvsproxy import agent, kpconfig, logs
from ipvsproxy.config import (
    MAX_DURATION,
    MAX_KERNEL_TIMEOUT,
    Config,
    parse_cidrs,
    parse_duration,
    parse_external_ip_cidrs,
    parse_interface_name,
    parse_port_range,
    parse_scheduler,
)
from ipvsproxy.errors import ConfigError
from ipvsproxy.model import IPNetwork
from ipvsproxy.serve import parse_bind_address
from ipvsproxy.sync.slowstart import MAX_WINDOW, ignored

log = logging.getLogger("ipvsproxy")
GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
FIELDS = "ipvsproxy.config_fields"  # ctx.meta: option -> "--config FILE: field ipvs.scheduler"


def given(ctx: click.Context, name: str) -> bool:
    """Whether the command line (or the environment) gave `name`, not a default or --config."""
    return ctx.get_parameter_source(name) in GIVEN


def flag(name: str, option: str) -> str:
    """How an error names where the value of `name` came from: `option`, or --config's file
    and field ("--config /etc/kp.yaml: field ipvs.scheduler")."""
    ctx = click.get_current_context(silent=True)
    fields: dict[str, str] = ctx.meta.get(FIELDS, {}) if ctx is not None else {}
    return fields.get(name, option)


def make_source(opts: dict[str, Any]) -> agent.Source:
    """--manifests, else the API. --config's clientConnection.kubeconfig yields to
    --manifests (as kube-proxy's flags win over its file); --kubeconfig, --context or
    --master given with it is an error."""
    paths = tuple(opts.pop("manifest_paths"))
    kubeconfig, context, master = opts.pop("kubeconfig"), opts.pop("context"), opts.pop("master")
    origin = flag("kubeconfig", "--kubeconfig")
    if paths and origin.startswith("--config"):
        kubeconfig = None
    if paths and (kubeconfig or context or master):
        raise ConfigError("--manifests and --kubeconfig/--context/--master exclude each other")
    if paths:
        return agent.Manifests(paths)
    return agent.Cluster(kubeconfig, context, master or None, origin=origin)


def ownership_config(opts: dict[str, Any]) -> dict[str, Any]:
    """The `Config` fields of `ownership_options`."""
    nodeport = opts["nodeport_addresses"]
    return {
        "nodeport_cidrs": parse_cidrs(
            "" if nodeport.strip() == "primary" else nodeport,
            option=flag("nodeport_addresses", "--nodeport-addresses"),
        ),
        "nodeport_primary": nodeport.strip() == "primary",
        "service_cidrs": parse_cidrs(opts["service_cidr"], option="--service-cidr"),
        "exclude_cidrs": parse_cidrs(
            opts["ipvs_exclude_cidrs"], option=flag("ipvs_exclude_cidrs", "--ipvs-exclude-cidrs")
        ),
        "nodeport_range": parse_port_range(
            opts["service_node_port_range"], option="--service-node-port-range"
        ),
        "dummy_device": parse_interface_name(opts["dummy_device"], option="--dummy-device"),
    }


def make_config(opts: dict[str, Any]) -> Config:
    """Build and validate the Config from parsed option values."""
    node_name = opts.get("hostname_override")
    cluster_cidrs, mode, interface = local_detection(opts)
    return Config(
        **({"node_name": node_name} if node_name else {}),
        scheduler=parse_scheduler(opts["scheduler"], option=flag("scheduler", "--scheduler")),
        **ownership_config(opts),
        backend=opts["backend"],
        fallback=not opts["no_fallback"],
        allow_no_firewall=opts["allow_no_firewall_rules"],
        firewall=opts["firewall"],
        first_services=parse_refs(opts["first_services"], "--first-services"),
        cluster_cidrs=cluster_cidrs,
        external_ip_cidrs=parse_external_ip_cidrs(
            opts["external_ip_cidrs"], option="--external-ip-cidrs"
        ),
        masquerade_all=opts["masquerade_all"],
        masquerade_bit=opts["masquerade_bit"],
        detect_local_mode=mode,
        local_interface=interface,
    )


def local_detection(opts: dict[str, Any]) -> tuple[tuple[IPNetwork, ...], str, str]:
    """--cluster-cidr, --detect-local-mode and the interface it needs, checked together."""
    cluster_cidrs = parse_cidrs(opts["cluster_cidr"], option=flag("cluster_cidr", "--cluster-cidr"))
    mode = opts["detect_local_mode"] or ("ClusterCIDR" if cluster_cidrs else "")
    needs = {
        "ClusterCIDR": ("--cluster-cidr", ",".join(map(str, cluster_cidrs))),
        "InterfaceNamePrefix": ("--pod-interface-name-prefix", opts["pod_interface_name_prefix"]),
        "BridgeInterface": ("--pod-bridge-interface", opts["pod_bridge_interface"]),
    }
    if mode == "ClusterCIDR" and not cluster_cidrs:
        # kube-proxy's getLocalDetector (cmd/kube-proxy/app/server_linux.go): a no-op
        # detector, as in the file `kube-proxy --write-config-to` writes without --cluster-cidr
        log.warning(
            "detect-local-mode ClusterCIDR without a cluster CIDR (--cluster-cidr, or "
            "clusterCIDR in --config): no traffic is detected as local, as in kube-proxy"
        )
        mode = ""
    elif mode in needs and not needs[mode][1]:
        where = flag("detect_local_mode", "--detect-local-mode")
        if where.startswith("--config"):
            field = kpconfig.field_of(needs[mode][0][2:].replace("-", "_"))
            raise ConfigError(f"{where}: {mode} needs {field} (or {needs[mode][0]})")
        raise ConfigError(f"{where} {mode} needs {needs[mode][0]}")
    for option_name, prefix in (
        ("--pod-interface-name-prefix", True),
        ("--pod-bridge-interface", False),
    ):
        name = option_name[2:].replace("-", "_")
        if opts[name]:  # checked whenever given: it is written into iptables-restore input
            parse_interface_name(opts[name], option=flag(name, option_name), prefix=prefix)
    interface = needs[mode][1] if mode in ("InterfaceNamePrefix", "BridgeInterface") else ""
    return cluster_cidrs, mode, interface


def from_config_file(opts: dict[str, Any], *, warn: bool = True) -> None:
    """Fill `opts` from `--config` where the command line (or the environment) gave no
    value, check `--proxy-mode`, warn once of what has no meaning here (unless not `warn`:
    `prepare` reads only a few of the file's fields, the agent warns of the file), apply the
    logging options. Precedence: command line > environment > file > defaults. A value from
    the file is checked as its flag is; an error names the file and the field."""
    ctx = click.get_current_context()
    path = opts.pop("config_file")
    loaded = kpconfig.load(path) if path is not None else kpconfig.Loaded()
    params = {param.name: param for param in ctx.command.params}
    fields: dict[str, str] = {}
    for name, value in loaded.values.items():
        if name not in opts or given(ctx, name):
            continue
        if name == "log_format" and given(ctx.find_root(), name):
            continue  # given before the subcommand
        where = f"--config {path}: field {loaded.fields[name]}"
        try:
            opts[name] = params[name].type.convert(value, params[name], ctx)
        except click.BadParameter as exc:
            raise ConfigError(f"{where}: {exc.message}") from None
        fields[name] = where
    ctx.meta[FIELDS] = fields
    apply_logging(opts)  # first: the warnings below come out in the format asked for
    if not warn:
        return
    flags = [
        f"--{name}"
        for name in kpconfig.IGNORED_FLAGS
        if kpconfig.meaningless(
            opts.pop(name.replace("-", "_"), None), kpconfig.IGNORED_FLAGS[name]
        )
    ]
    if flags:
        log.warning("ignored (no meaning for ipvsproxy): %s", ", ".join(flags))
    if loaded.ignored:
        log.warning("--config %s: ignored (no meaning for ipvsproxy): %s", path,
                    ", ".join(loaded.ignored))  # fmt: skip
    mode = opts.pop("proxy_mode").strip()
    if mode not in ("", "ipvs"):
        raise ConfigError(f"--proxy-mode {mode!r}: ipvsproxy is an IPVS proxy (ipvs only)")


def apply_logging(opts: dict[str, Any]) -> None:
    """The logging options of a subcommand (popped from `opts`): given after it (or set by
    --config), they win over those given before it."""
    ctx = click.get_current_context()
    level, log_format, verbosity = opts.pop("log_level"), opts.pop("log_format"), opts.pop("v")
    if given(ctx, "log_level"):
        logs.set_level(level)
    if given(ctx, "log_format") or "log_format" in ctx.meta.get(FIELDS, {}):
        logs.set_format(log_format)
    logs.set_verbosity(verbosity)


def conntrack_config(opts: dict[str, Any]) -> dict[str, Any]:
    """The `Config` fields of the `--conntrack-*` options (popped from `opts`); durations
    in whole seconds, as kube-proxy truncates them."""

    def seconds(name: str) -> int:
        option = flag(name, "--" + name.replace("_", "-"))
        return int(parse_duration(opts.pop(name), option=option, maximum=MAX_KERNEL_TIMEOUT))

    return {
        "conntrack_max_per_core": opts.pop("conntrack_max_per_core"),
        "conntrack_min": opts.pop("conntrack_min"),
        "conntrack_tcp_be_liberal": opts.pop("conntrack_tcp_be_liberal"),
        **{
            name: seconds(name)
            for name in (
                "conntrack_tcp_timeout_established",
                "conntrack_tcp_timeout_close_wait",
                "conntrack_udp_timeout",
                "conntrack_udp_timeout_stream",
            )
        },
    }


def run_config(opts: dict[str, Any]) -> Config:
    """`make_config` plus run's own options."""

    def seconds(name: str, maximum: float = MAX_DURATION) -> float:
        option = flag(name, "--" + name.replace("_", "-"))
        return parse_duration(opts.pop(name), option=option, maximum=maximum)

    def bind(name: str) -> tuple[str, int]:
        text = opts.pop(f"{name}_bind_address")
        port = opts.pop(f"{name}_port")
        option_name = flag(f"{name}_bind_address", f"--{name}-bind-address")
        if _is_ip(text):  # kube-proxy's AppendPortIfNeeded: --<name>-port's, by default its own
            text = f"[{text}]:{port}" if ":" in text else f"{text}:{port}"
        return parse_bind_address(text, option=option_name)

    texts = {name: opts[name] for name in ("min_sync_period", "sync_period")}
    min_sync, sync_period, drain = (
        seconds(n) for n in ("min_sync_period", "sync_period", "drain_timeout")
    )
    if sync_period <= 0:
        raise ConfigError(f"{flag('sync_period', '--sync-period')}: must be positive")
    if min_sync > sync_period:
        raise ConfigError(
            f"{flag('min_sync_period', '--min-sync-period')}: {texts['min_sync_period']!r} is "
            f"longer than the sync period ({flag('sync_period', '--sync-period')}: "
            f"{texts['sync_period']!r})"
        )
    config = dataclasses.replace(
        make_config(opts),
        strict_arp=opts.pop("strict_arp"),
        tcp_timeout=int(seconds("tcp_timeout", MAX_KERNEL_TIMEOUT)),
        tcp_fin_timeout=int(seconds("tcp_fin_timeout", MAX_KERNEL_TIMEOUT)),
        udp_timeout=int(seconds("udp_timeout", MAX_KERNEL_TIMEOUT)),
        **conntrack_config(opts),
        min_sync_period=min_sync,
        sync_period=sync_period,
        drain_timeout=drain,
        metrics_bind_address=bind("metrics"),
        healthz_bind_address=bind("healthz"),
        **service_metrics_config(opts),
        slow_start=seconds("slow_start", MAX_WINDOW),
    )
    if config.slow_start and not config.scheduler.honours_weights:
        log.warning(
            "--slow-start: %s: off for the Services that keep the default scheduler",
            ignored(config.scheduler),
        )
    return config


def service_metrics_config(opts: dict[str, Any]) -> dict[str, Any]:
    """The `Config` fields of the metrics port's own options (popped from `opts`)."""
    service, endpoint = opts.pop("service_metrics"), opts.pop("endpoint_metrics")
    if endpoint and not service:
        raise ConfigError("--endpoint-metrics needs --service-metrics")
    secure = opts.pop("secure_metrics_bind_address")
    cert, key = opts.pop("tls_cert_file"), opts.pop("tls_private_key_file")
    if (cert or key) and not secure:
        raise ConfigError(
            "--tls-cert-file/--tls-private-key-file need --secure-metrics-bind-address"
        )
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert-file and --tls-private-key-file go together: give both")
    return {
        "secure_metrics_bind_address": (
            parse_bind_address(secure, option="--secure-metrics-bind-address") if secure else None
        ),
        "tls_cert_file": cert,
        "tls_private_key_file": key,
        "service_metrics": service,
        "endpoint_metrics": endpoint,
        "service_metrics_max_series": opts.pop("service_metrics_max_series"),
        "status_remote": opts.pop("status_remote"),
    }


def _is_ip(text: str) -> bool:
    try:
        ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def parse_refs(text: str, option: str) -> tuple[tuple[str, str], ...]:
    """`NS/NAME,...` as (namespace, name) pairs; ConfigError naming the bad one."""
    refs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        namespace, slash, name = item.partition("/")
        if not (slash and namespace and name) or "/" in name:
            raise ConfigError(f"{option}: {item!r} is not NAMESPACE/NAME")
        refs.append((namespace, name))
    return tuple(refs)
