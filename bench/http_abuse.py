"""The agent's HTTP ports under abuse (issue 28): probe latency while slow clients hold
connections and while a burst of connections is opened at once.

  python -m bench.http_abuse [--slow 1000] [--burst 10000] [--probes 300] [--ports 20]

A server process runs what the agent runs: the health port (/healthz, /livez) and `--ports`
health-check node ports (ServiceHealth), all on 127.0.0.1. This process then
1. opens `--slow` clients (half on the health port, half spread over the node ports), each
   sending a request head 2 bytes a second and reconnecting when cut off (the issue's
   attack), and probes /healthz and a node port in turn (`--probes`, a new connection each,
   10 ms apart), then
2. while the slow clients go on, opens `--burst` connections at once (non-blocking connects,
   held open) to the health port and probes again meanwhile.
The attackers run in a process of their own, so the
probes time the server, not the prober's contention with them. It prints p50/p99/max of
each phase, and the server's threads, open descriptors, RSS and CPU seconds half way
through it.
A probe that fails or takes more than 2 s counts as 2 s. Raises its own soft descriptor
limit (and the server's) to the hard limit; needs about slow + burst + 2,000 descriptors.
Needs no root and no namespace: loopback only.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from typing import Any

SERVER = """
import resource, sys, time
from ipaddress import ip_address
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
from ipvsproxy.healthcheck import ServiceHealth
from ipvsproxy.serve import Health, HttpServer
health = Health(timeout=60)
server = HttpServer(("127.0.0.1", 0), {"/healthz": health.healthz, "/livez": health.livez})
server.start()
checks = ServiceHealth(healthy=health.healthy)
ports = [int(p) for p in sys.argv[1:]]
checks.sync({f"default/s{i}": (p, 1) for i, p in enumerate(ports)}, [ip_address("127.0.0.1")])
print(server.port, flush=True)
sys.stdin.read()
"""
TIMEOUT = 2.0


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def probe(port: int, path: str) -> float:
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return TIMEOUT
    took = time.monotonic() - started
    return took if b" 200 " in data.split(b"\r\n", 1)[0] and took < TIMEOUT else TIMEOUT


def probes(targets: list[tuple[int, str]], count: int) -> list[float]:
    out = []
    for i in range(count):
        out.append(probe(*targets[i % len(targets)]))
        time.sleep(0.01)
    return out


class Slow(threading.Thread):
    """Clients trickling a request head at 2 bytes/s, reconnecting when cut off."""

    def __init__(self, ports: list[int], count: int) -> None:
        super().__init__(name="slow", daemon=True)
        self.ports, self.count = ports, count
        self.socks: list[socket.socket | None] = [None] * count
        self.stop = threading.Event()

    def connect(self, i: int) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.ports[i % len(self.ports)]), 2)
        except OSError:
            return None
        sock.setblocking(False)
        return sock

    def run(self) -> None:
        for i in range(self.count):
            self.socks[i] = self.connect(i)
        while not self.stop.wait(0.5):
            for i, sock in enumerate(self.socks):
                try:
                    if sock is None:
                        raise ConnectionError
                    sock.send(b"G")
                except BlockingIOError:
                    continue
                except OSError:
                    if sock is not None:
                        sock.close()
                    self.socks[i] = self.connect(i)


def burst(port: int, count: int, held: list[socket.socket]) -> None:
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        held.append(sock)


def report(name: str, samples: list[float]) -> None:
    s = sorted(samples)
    at = lambda q: s[min(len(s) - 1, int(len(s) * q))] * 1000  # noqa: E731
    print(f"{name:<34} n={len(s):<4} p50 {at(0.5):7.1f} ms  p99 {at(0.99):7.1f} ms  "
          f"max {s[-1] * 1000:7.1f} ms")  # fmt: skip


def server_load(pid: int) -> str:
    threads = len(os.listdir(f"/proc/{pid}/task"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as status:
        rss = next(line for line in status if line.startswith("VmRSS")).split()[1]
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return (
        f"server: {threads} threads, {fds} descriptors, RSS {int(rss) // 1024} MiB, CPU {cpu:.1f} s"
    )


def attack(port: int, hc_ports: list[int], slow: int, count: int, go: Any) -> None:
    """The attackers: slow clients at once, the burst when `go` is set."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    clients = Slow([port, *hc_ports], slow)
    clients.start()
    go.wait()
    held: list[socket.socket] = []
    burst(port, count, held)
    time.sleep(3600)


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--slow", type=int, default=1000)
    args.add_argument("--burst", type=int, default=10000)
    args.add_argument("--probes", type=int, default=300)
    args.add_argument("--ports", type=int, default=20)
    opts = args.parse_args()
    hc_ports = free_ports(opts.ports)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, *map(str, hc_ports)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    targets = [(port, "/healthz"), (hc_ports[0], "/"), (port, "/livez"), (hc_ports[-1], "/")]
    go = multiprocessing.Event()
    attackers = multiprocessing.Process(
        target=attack, args=(port, hc_ports, opts.slow, opts.burst, go), daemon=True
    )
    try:
        report("idle", probes(targets, 50))
        attackers.start()
        time.sleep(2)
        half = probes(targets, opts.probes // 2)
        load = server_load(proc.pid)
        report(f"{opts.slow} slow clients", half + probes(targets, opts.probes - len(half)))
        print(load)
        go.set()
        half = probes(targets, opts.probes // 2)
        load = server_load(proc.pid)
        report(
            f"+ {opts.burst} connections at once", half + probes(targets, opts.probes - len(half))
        )
        print(load, "(half way through each phase)")
    finally:
        attackers.kill()
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
