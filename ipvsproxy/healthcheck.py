"""Health-check node ports: what a cloud load balancer asks a node before sending it traffic.

Owns: `ServiceHealth`, kube-proxy's ServiceHealthServer (pkg/proxy/healthcheck/
service_health.go). For every LoadBalancer Service with `externalTrafficPolicy: Local` and
a `spec.healthCheckNodePort`, an HTTP server on that port answers any path with 200 when the
Service has at least one ready endpoint on this node and the proxy is healthy, else 503;
header `X-Load-Balancing-Endpoint-Weight` is the local endpoint count, the body kube-proxy's
JSON (`service`, `localEndpoints`, `serviceProxyHealthy`). Without it a cloud load balancer
sees every node as down, or sends traffic to nodes with no local pod.

`sync()` opens the servers of new Services, closes those of Services gone (or moved to
another port) and updates the counts, after each completed sync pass. Servers listen on
the NodePort addresses when `--nodeport-addresses` restricts them, else on every address
(`::`, dual-stack; `0.0.0.0` where the host has no IPv6). A port that cannot be bound is
logged once, counted (`on_bind_error`) and tried again at the next sync, never fatal.

Every port is an `HttpServer` (serve.py): all of them, whatever their number, share the
process's one HTTP event loop and thread, its per-connection deadline, head limit and cap
on open connections, so slow clients on one port delay no answer on another. Answers are
computed in that loop's thread (`_answer` takes the lock `sync` holds only briefly).

Imports: serve, errors, model, the standard library.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ipvsproxy.errors import ConfigError
from ipvsproxy.model import IPAddress
from ipvsproxy.serve import JSON_HEADERS, Headed, HttpServer

log = logging.getLogger(__name__)

Checks = Mapping[str, tuple[int, int]]  # "namespace/name" -> (port, local ready endpoints)
WEIGHT_HEADER = "X-Load-Balancing-Endpoint-Weight"


@dataclass
class _Instance:
    port: int
    servers: list[HttpServer] = field(default_factory=list)
    local: int = 0


class ServiceHealth:
    def __init__(
        self,
        *,
        healthy: Callable[[], bool],
        on_bind_error: Callable[[], None] = lambda: None,
        server: Callable[..., HttpServer] = HttpServer,
    ) -> None:
        self._healthy = healthy
        self._on_bind_error = on_bind_error
        self._server = server
        self._lock = threading.Lock()
        self._services: dict[str, _Instance] = {}
        self._addresses: tuple[str, ...] = ()
        self._failed: dict[str, int] = {}  # Service -> the port last logged as unbindable

    @property
    def ports(self) -> dict[str, int]:
        """The Services served and their ports."""
        with self._lock:
            return {ref: inst.port for ref, inst in self._services.items()}

    def sync(self, checks: Checks, addresses: Sequence[IPAddress] = ()) -> None:
        """Serve exactly `checks`; `addresses`: where to listen (none: every address). A
        change of addresses reopens every server."""
        hosts = tuple(str(a) for a in addresses)
        with self._lock:
            gone = [
                ref
                for ref, inst in self._services.items()
                if ref not in checks or checks[ref][0] != inst.port or hosts != self._addresses
            ]
            closing = [self._services.pop(ref) for ref in gone]
            self._addresses = hosts
            for ref, (_, local) in checks.items():
                if ref in self._services:
                    self._services[ref].local = local
        for inst, ref in zip(closing, gone, strict=True):
            log.info("closing the health check of Service %s on port %d", ref, inst.port)
            _close(inst.servers)
        for ref, (port, local) in checks.items():
            if ref in self._services:
                continue
            servers = self._open(ref, port)
            if servers is None:
                continue
            with self._lock:
                self._services[ref] = _Instance(port, servers, local)
        for ref in set(self._failed) - set(checks):
            del self._failed[ref]

    def close(self) -> None:
        with self._lock:
            instances, self._services = list(self._services.values()), {}
        for inst in instances:
            _close(inst.servers)

    def _open(self, ref: str, port: int) -> list[HttpServer] | None:
        routes = {"*": lambda: self._answer(ref)}
        hosts = self._addresses or ("::",)
        servers: list[HttpServer] = []
        try:
            for host in hosts:
                try:
                    servers.append(self._server((host, port), routes))
                except ConfigError:
                    if host != "::":
                        raise
                    servers.append(self._server(("0.0.0.0", port), routes))  # no IPv6 here
        except ConfigError as exc:
            _close(servers)
            self._on_bind_error()
            if self._failed.get(ref) != port:
                log.error("cannot serve the health check of Service %s: %s", ref, exc)
                self._failed[ref] = port
            return None
        self._failed.pop(ref, None)
        log.info("serving the health check of Service %s on port %d", ref, port)
        return [server.start() for server in servers]

    def _answer(self, ref: str) -> Headed:
        with self._lock:
            inst = self._services.get(ref)
            local = inst.local if inst is not None else 0
        healthy = self._healthy()
        namespace, _, name = ref.partition("/")
        body = {
            "service": {"namespace": namespace, "name": name},
            "localEndpoints": local,
            "serviceProxyHealthy": healthy,
        }
        code = 200 if local and healthy else 503
        headers = {**JSON_HEADERS, WEIGHT_HEADER: str(local)}
        return code, "application/json", json.dumps(body).encode() + b"\n", headers


def _close(servers: Sequence[HttpServer]) -> None:
    for server in servers:
        server.close()
