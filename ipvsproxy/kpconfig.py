"""kube-proxy's configuration file (`--config`): a KubeProxyConfiguration read into options.

Owns: `load()`. The file is what kubeadm's `kube-proxy` ConfigMap holds (`config.conf`) or
what `kube-proxy --write-config-to` writes: `kubeproxy.config.k8s.io/v1alpha1`, YAML or
JSON. Every field with a meaning here becomes the value of the `ipvsproxy run` option that
means the same (named as the CLI names its parameters, in the types the CLI takes); the CLI
gives command-line flags (and the environment) precedence over it, and it precedence over
defaults (docs/kube-proxy-compat.md).

A field left at its zero value (null, "", 0, 0s, false), as kubeadm's file leaves them, is
unset: the option keeps its default. Fields with no meaning here (another proxy mode's,
profiling, client rate limits, ...) are named in one warning when set to anything but
their zero value or kube-proxy's default; a field kube-proxy does not know is an error, as
kube-proxy's strict decoding makes it one. `mode` is kube-proxy's (the file is the one
kube-proxy reads while a cluster moves node by node, docs/migration.md): any mode of
kube-proxy on Linux is accepted, and ipvsproxy serves the node with IPVS whatever it says;
in nftables mode the masquerade fields are read from the `nftables` section, as kube-proxy
reads them in that mode. kube-proxy's flags with no meaning here (`IGNORED_FLAGS`) are
warned of by the same rule.

The file is read as a manifest file is (manifests.read_bytes, manifests.parse): a regular
file only, its size, documents, aliases and nesting bounded, any YAML or JSON a ConfigError
naming the file, never another exception (tests/test_kpconfig_bounds.py fuzzes it).

Imports: manifests, errors, logs (escape), the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipvsproxy import manifests
from ipvsproxy.errors import ConfigError
from ipvsproxy.logs import escape

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"

# (section, field) -> the run option it sets; section "" is the top level
MEANINGFUL: dict[tuple[str, str], str] = {
    ("clientConnection", "kubeconfig"): "kubeconfig",
    ("", "hostnameOverride"): "hostname_override",
    ("", "healthzBindAddress"): "healthz_bind_address",
    ("", "metricsBindAddress"): "metrics_bind_address",
    ("", "clusterCIDR"): "cluster_cidr",
    ("", "detectLocalMode"): "detect_local_mode",
    ("detectLocal", "bridgeInterface"): "pod_bridge_interface",
    ("detectLocal", "interfaceNamePrefix"): "pod_interface_name_prefix",
    ("", "nodePortAddresses"): "nodeport_addresses",
    ("ipvs", "scheduler"): "scheduler",
    ("ipvs", "syncPeriod"): "sync_period",
    ("ipvs", "minSyncPeriod"): "min_sync_period",
    ("ipvs", "excludeCIDRs"): "ipvs_exclude_cidrs",
    ("ipvs", "strictARP"): "strict_arp",
    ("ipvs", "tcpTimeout"): "tcp_timeout",
    ("ipvs", "tcpFinTimeout"): "tcp_fin_timeout",
    ("ipvs", "udpTimeout"): "udp_timeout",
    ("iptables", "masqueradeAll"): "masquerade_all",
    ("iptables", "masqueradeBit"): "masquerade_bit",
    ("conntrack", "maxPerCore"): "conntrack_max_per_core",
    ("conntrack", "min"): "conntrack_min",
    ("conntrack", "tcpEstablishedTimeout"): "conntrack_tcp_timeout_established",
    ("conntrack", "tcpCloseWaitTimeout"): "conntrack_tcp_timeout_close_wait",
    ("conntrack", "tcpBeLiberal"): "conntrack_tcp_be_liberal",
    ("conntrack", "udpTimeout"): "conntrack_udp_timeout",
    ("conntrack", "udpStreamTimeout"): "conntrack_udp_timeout_stream",
    ("logging", "format"): "log_format",
    ("logging", "verbosity"): "v",
}
# Fields kube-proxy knows that mean nothing here, with kube-proxy's defaults (not warned)
IGNORED: dict[tuple[str, str], tuple[object, ...]] = {
    ("", "bindAddress"): ("0.0.0.0", "::"),
    ("", "bindAddressHardFail"): (),
    ("", "configSyncPeriod"): ("15m0s",),
    ("", "enableProfiling"): (),
    ("", "featureGates"): (),
    ("", "oomScoreAdj"): (-999,),
    ("", "portRange"): (),
    ("", "showHiddenMetricsForVersion"): (),
    ("", "windowsRunAsService"): (),
    ("clientConnection", "acceptContentTypes"): (),
    ("clientConnection", "contentType"): ("application/vnd.kubernetes.protobuf",),
    ("clientConnection", "qps"): (5,),
    ("clientConnection", "burst"): (10,),
    ("iptables", "localhostNodePorts"): (True,),
    ("iptables", "minSyncPeriod"): ("1s",),
    ("iptables", "syncPeriod"): ("30s",),
    ("nftables", "masqueradeAll"): (),
    ("nftables", "masqueradeBit"): (14,),
    ("nftables", "minSyncPeriod"): ("1s",),
    ("nftables", "syncPeriod"): ("30s",),
    ("logging", "flushFrequency"): ("5s", 5000000000),
    ("logging", "options"): ({"json": {"infoBufferSize": "0"}, "text": {"infoBufferSize": "0"}},),
    ("logging", "vmodule"): (),
}
# kube-proxy's flags that mean nothing here (cmd/kube-proxy/app/options.go and the logging
# flags of k8s.io/component-base, v1.36), with kube-proxy's defaults: the CLI accepts them
# and names the ones given in one warning, by the rule of the fields above (`meaningless`)
IGNORED_FLAGS: dict[str, tuple[object, ...]] = {
    "feature-gates": (),
    "bind-address": ("0.0.0.0", "::"),
    "bind-address-hard-fail": (),
    "profiling": (),
    "show-hidden-metrics-for-version": (),
    "iptables-localhost-nodeports": (True,),
    "iptables-sync-period": ("30s",),
    "iptables-min-sync-period": ("1s",),
    "kube-api-content-type": ("application/vnd.kubernetes.protobuf",),
    "kube-api-qps": (5,),
    "kube-api-burst": (10,),
    "oom-score-adj": (-999,),
    "config-sync-period": ("15m0s", "15m"),
    "vmodule": (),
    "log-flush-frequency": ("5s",),
    "log-text-split-stream": (),
    "log-text-info-buffer-size": ("0",),
    "log-json-split-stream": (),
    "log-json-info-buffer-size": ("0",),
}
# nftables mode: kube-proxy reads masqueradeAll and masqueradeBit from the nftables section
_IPTABLES_MASQ = {("iptables", "masqueradeAll"): (), ("iptables", "masqueradeBit"): (14,)}
_NFTABLES_MASQ = {("nftables", "masqueradeAll"): "masquerade_all",
                  ("nftables", "masqueradeBit"): "masquerade_bit"}  # fmt: skip
MODE_FIELDS: dict[str, tuple[dict[tuple[str, str], str], dict[tuple[str, str], tuple[object, ...]]]]
MODE_FIELDS = {
    "nftables": (
        {k: v for k, v in MEANINGFUL.items() if k not in _IPTABLES_MASQ} | _NFTABLES_MASQ,
        {k: v for k, v in IGNORED.items() if k not in _NFTABLES_MASQ} | _IPTABLES_MASQ,
    ),
}
# kube-proxy's modes on Linux ("" is iptables mode, kubeadm's default)
KUBE_PROXY_MODES = ("", "ipvs", "iptables", "nftables")
SECTIONS = {"clientConnection", "conntrack", "detectLocal", "ipvs", "iptables", "logging",
            "nftables", "winkernel"}  # fmt: skip
TOP = {"apiVersion", "kind", "mode"} | SECTIONS


@dataclass(frozen=True, slots=True)
class Loaded:
    """The options the file sets, and what it sets that has no meaning here."""

    values: Mapping[str, object] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    fields: Mapping[str, str] = field(default_factory=dict)  # option -> its field, "ipvs.scheduler"


def load(path: Path) -> Loaded:
    """Read and check one KubeProxyConfiguration file; ConfigError naming the file (and
    the field) for anything wrong."""
    try:
        documents = manifests.parse(path, manifests.read_bytes(path))
        if len(documents) > 1:
            raise ConfigError(f"{path}: {len(documents)} documents, expected one")
    except ConfigError as exc:  # already naming the file
        raise ConfigError(f"--config {exc}") from None
    try:
        return parse(documents[0] if documents else None)
    except ConfigError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None


def parse(doc: object) -> Loaded:
    if not isinstance(doc, Mapping):
        raise ConfigError("expected a KubeProxyConfiguration object")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise ConfigError(
            f"apiVersion {doc.get('apiVersion')!r}, kind {doc.get('kind')!r}: expected "
            f"{API_VERSION} {KIND}"
        )
    mode = doc.get("mode") or ""
    if mode not in KUBE_PROXY_MODES:
        raise ConfigError(
            f"field mode: {escape(repr(mode))}: not a mode of kube-proxy on Linux (ipvs, "
            "iptables, nftables, or empty); ipvsproxy serves the node with IPVS whatever it says"
        )
    meaningful, ignored_fields = MODE_FIELDS.get(mode, (MEANINGFUL, IGNORED))
    values: dict[str, object] = {}
    ignored: list[str] = []
    origins: dict[str, str] = {}
    for section, fields in _fields(doc):
        for name, value in fields.items():
            where = f"{section}.{name}" if section else name
            option = meaningful.get((section, name))
            if option is not None:
                converted = _value(option, value, where)
                if converted is not None:
                    values[option] = converted
                    origins[option] = where
            elif (section, name) in ignored_fields or section == "winkernel":
                if meaningless(value, ignored_fields.get((section, name), ())):
                    ignored.append(where)
            else:
                raise ConfigError(  # the name is the file's: a newline in it stays one line
                    f"field {escape(str(where))}: unknown field (kube-proxy would refuse it too)"
                )
    return Loaded(values, tuple(ignored), origins)


def field_of(option: str) -> str:
    """The field that sets `option` ("detectLocal.interfaceNamePrefix")."""
    section, name = next(key for key, value in MEANINGFUL.items() if value == option)
    return f"{section}.{name}" if section else name


def meaningless(value: object, defaults: tuple[object, ...]) -> bool:
    """Whether a field (or flag) with no meaning here is worth a warning: set to anything
    but its zero value or kube-proxy's default."""
    return not _zero(value) and value not in defaults


def _fields(doc: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    top = {k: v for k, v in doc.items() if k not in TOP}
    out: list[tuple[str, Mapping[str, Any]]] = [("", top)]
    for section in sorted(SECTIONS & doc.keys()):
        value = doc[section]
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(f"field {section}: expected an object, got {type(value).__name__}")
        out.append((section, value))
    for name in top:
        if ("", name) not in MEANINGFUL and ("", name) not in IGNORED:
            raise ConfigError(
                f"field {escape(str(name))}: unknown field (kube-proxy would refuse it too)"
            )
    return out


def _zero(value: object) -> bool:
    return value in (None, "", 0, False, "0s", "0") or value == [] or value == {}


_STRINGS = {"kubeconfig", "hostname_override", "cluster_cidr", "detect_local_mode",
            "pod_bridge_interface", "pod_interface_name_prefix", "scheduler", "log_format",
            "healthz_bind_address", "metrics_bind_address"}  # fmt: skip
_DURATIONS = {"sync_period", "min_sync_period", "tcp_timeout", "tcp_fin_timeout", "udp_timeout",
              "conntrack_tcp_timeout_established", "conntrack_tcp_timeout_close_wait",
              "conntrack_udp_timeout", "conntrack_udp_timeout_stream"}  # fmt: skip
_LISTS = {"nodeport_addresses", "ipvs_exclude_cidrs"}
_BOOLS = {"strict_arp", "masquerade_all", "conntrack_tcp_be_liberal"}
# where kube-proxy's zero is a value of its own, not "unset": a conntrack count of 0 leaves
# the kernel's limit; a verbosity of 0 is a verbosity
_ZERO_SET = {"conntrack_max_per_core", "conntrack_min", "v"}


def _value(option: str, value: object, where: str) -> object | None:
    """The option's value in the type the CLI takes it; None: unset (its zero value)."""
    if value is None:
        return None
    if option in _STRINGS or option in _DURATIONS:
        return _string(value, where, duration=option in _DURATIONS)
    if option in _LISTS:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"field {where}: expected a list of strings")
        return ",".join(value) or None
    if option in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"field {where}: expected true or false, got {value!r}")
        return value or None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"field {where}: expected a non-negative integer, got {value!r}")
    return value if value or option in _ZERO_SET else None


def _string(value: object, where: str, *, duration: bool) -> str | None:
    """A string option (host:port, CIDR, name, Go duration: the CLI checks it as it
    checks its flag); "" and a zero duration are unset."""
    if not isinstance(value, str):
        raise ConfigError(f"field {where}: expected a string, got {type(value).__name__}")
    if duration and value in ("0s", "0"):
        return None
    return value or None
