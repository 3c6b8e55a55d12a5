"""The whole path, as an operator meets it: the figures of docs/performance.md in one VM boot.

Run inside the IPVS VM as root (scripts/bench-whole does that); prints a table. A generated
cluster (bench/common.py `cluster()`: S Services x D endpoints in slices of at most 100, one
in ten a NodePort, one in ten with two ports, `--load-balancer-every N` a LoadBalancer,
endpoints over 5 nodes, this node `node-0` among them; `--api-service` adds the API's and the
cluster DNS's Services) is written as
one JSON `List`; `tests.factories.from_objects` + `saved_table.render_save` give the
exact virtual and real servers ipvsproxy should program, as `ipvsadm -R` input. Every
measurement runs in a fresh network namespace (IPVS state, ipsets and iptables are per
namespace) and every table is checked against `ipvsadm-save -n`.

  row                               what is timed                              ratio to
  ipvsadm -R (floor)                loading the rules                          itself
  ipvsadm -S -n (floor)             dumping the loaded table                   itself
  ipset + iptables-restore (floor)  the first pass's firewall state, loaded    itself
  nft -f (floor)                    the same as one nftables table             itself
  run --once, S x D / empty         the console script, whole process, exit 0  ipvsadm -R
  run --once, marginal              the difference of the two (of their        ipvsadm -R
                                    medians; and the median of the differences
                                    of each big run and the empty run before it)
  agent: first complete sync        process start -> the whole table in the    ipvsadm -R
                                    kernel (polling /proc/net/ip_vs)
  agent: idle periodic resync       the agent's own `sync: ... Ns` log line,   ipvsadm -S -n of
                                    median of --idle                           its table, beside
  agent: one slice change           API write -> the new destination in the    seconds
                                    kernel (polling its virtual server)
  agent: event-driven sync          the agent's log line for that sync         seconds
  agent: first sync (log)           process start -> the first full pass's     ipvsadm -R +
                                    log line: table, firewall, VIPs all in     ipset restore +
                                                                               iptables-restore
  agent: the API's VIP answers      process start -> a TCP handshake through   seconds
                                    10.96.0.1:443 (--api-service)
  agent: idle CPU per sync period   the agent's CPU between idle resyncs       seconds
  agent: peak RSS                   VmHWM at the end                           MiB
  restart (parts restart)           SIGTERM, a new agent on the complete       writes, counts,
                                    table: its first pass, the fewest virtual  probes
                                    servers seen during it, API VIP probes
                                    failed, a held connection

The agent runs against the test API server (tests/kubeapi.py: the real list/watch protocol
over HTTPS), which runs in this process inside the agent's namespace and shares the VM's
2 vCPUs with it. Compare ratios within one run only: the VM emulates every instruction.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    API_VIP,
    BENCH_NODE,
    NODES,
    POD_NETWORK,
    TWO_PORTS_EVERY,
    RawObject,
    cluster,
    cluster_ip,
    cluster_node,
    critical_services,
    fresh_netns,
    is_load_balancer,
    is_node_port,
    node_ip,
    pod_ip,
    timed,
)
from integration.lab import agent_command, inside  # noqa: E402
from ipvsproxy.config import Config, parse_cidrs  # noqa: E402
from ipvsproxy.errors import KernelError  # noqa: E402
from ipvsproxy.firewall.firewall_plan import Observed  # noqa: E402
from ipvsproxy.firewall.host_firewall import Firewall, ipset_script  # noqa: E402
from ipvsproxy.firewall.nft_firewall import NftFirewall  # noqa: E402
from ipvsproxy.firewall.set_index import SetIndex  # noqa: E402
from ipvsproxy.firewall.sets import SetState  # noqa: E402
from ipvsproxy.model import IpvsState, Proto, RSKey, VSKey  # noqa: E402
from ipvsproxy.netlink.ipvs_kernel import NetlinkKernel  # noqa: E402
from ipvsproxy.policy import node_policy  # noqa: E402
from ipvsproxy.saved_table import parse_save, render_save  # noqa: E402
from tests.factories import from_objects  # noqa: E402

SERVICE_CIDR = "10.96.0.0/16"
API_PORT = 6443  # the test API server's, on every address of the agent's namespace
# the firewall's masquerade rules, as kube-proxy; --firewall as main() says (set there)
NODE_FLAGS = ["--cluster-cidr", POD_NETWORK]


# ---- helpers ------------------------------------------------------------------------------


def in_ns(ns: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *args], text=True, **kwargs)


def saved(ns: str) -> IpvsState:
    out = in_ns(ns, "ipvsadm-save", "-n", capture_output=True, check=True).stdout
    return parse_save(out)


def same_table(ns: str, want: IpvsState, changed: int = 0) -> str:
    """'' when the namespace's IPVS table is `want`, but for the `changed` destinations the
    slice changes added (each a new endpoint of one Service), else what differs (briefly)."""
    got = saved(ns)
    if (got.services, got.dests) == (want.services, want.dests):
        return ""
    missing = [k for k in want.services if got.services.get(k) != want.services[k]]
    wrong = [k for k in want.services if k in got.dests and got.dests[k] != want.dests[k]]
    added = sum(len(got.dests[k]) - len(want.dests[k]) for k in wrong)
    grown = all(want.dests[k].items() <= got.dests[k].items() for k in wrong)
    if not missing and grown and added == changed and len(got.services) == len(want.services):
        return ""
    extra = [k for k in got.services if k not in want.services]
    return (
        f"{len(got.services)} virtual servers, {len(missing)} missing or different "
        f"(e.g. {missing[:1]}), {len(wrong)} with other destinations (e.g. {wrong[:1]}), "
        f"{len(extra)} unexpected (e.g. {extra[:1]})"
    )


def write_list(path: Path, objects: list[RawObject]) -> Path:
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    return path


@dataclass
class Row:
    what: str
    approach: str
    seconds: float | None
    base: float | None  # None: no ratio (an absolute target)
    note: str = ""


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *args: Any, **kwargs: Any) -> None:
        """A row, also said at once (a run stopped before its table still shows it)."""
        row = Row(*args, **kwargs)
        self.rows.append(row)
        say(f"row: {row.what}: {row.approach}: {row.seconds} ({row.note})")

    def problem(self, text: str) -> None:
        print(f"bench: PROBLEM: {text}", file=sys.stderr, flush=True)
        self.problems.append(text)


def say(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


# ---- floors -------------------------------------------------------------------------------


def floors(state: IpvsState, repeat: int, out: Results) -> tuple[float, float]:
    rules = render_save(state)
    restores, dumps = [], []
    for _ in range(repeat):
        with fresh_netns() as ns:
            restores.append(
                timed(lambda: in_ns(ns, "ipvsadm", "-R", input=rules, check=True))  # noqa: B023
            )
            if diff := same_table(ns, state):
                out.problem(f"ipvsadm -R did not load the rules: {diff}")
            dumps.append(
                timed(lambda: in_ns(ns, "ipvsadm", "-S", "-n", capture_output=True, check=True))  # noqa: B023
            )
    restore, dump = statistics.median(restores), statistics.median(dumps)
    out.add("floor", "ipvsadm -R", restore, restore)
    out.add("floor", "ipvsadm -S -n", dump, dump)
    return restore, dump


class _Recorder:
    """An nftables runner that keeps the scripts it is given (the floor's `nft -f` input)."""

    name = "nft"

    def __init__(self) -> None:
        self.scripts: list[str] = []

    def run(self, script: str, *, check: bool = False) -> None:
        self.scripts.append(script)

    def close(self) -> None:
        pass


def firewall_floors(objects: list[RawObject], repeat: int, out: Results) -> tuple[float, float]:
    """The firewall state of the agent's first pass (its sets and rules, as ipvsproxy's
    firewall step renders them for this cluster) loaded into an empty namespace by the tools
    alone: `ipset restore` + `iptables-restore` (the iptables firewall), and `nft -f` (the
    nftables one). Returns their medians, in that order."""
    config = Config(
        node_name=BENCH_NODE,
        service_cidrs=parse_cidrs(SERVICE_CIDR, option="service-cidr"),
        cluster_cidrs=parse_cidrs(POD_NETWORK, option="cluster-cidr"),
    )
    desired, _ = from_objects(objects, config)
    index = SetIndex(versions=(4,))
    index.reset(desired.state, desired.access, local=desired.local_endpoints)
    wanted, empty = index.wanted(), Observed(SetState({}), {})
    iptables = Firewall(options=node_policy(config), versions=(4,))
    plan = iptables.plan(wanted, empty)
    sets = ipset_script(plan.sets)
    rules = "".join(payload for _, _, payload in plan.restores)
    recorder = _Recorder()
    nft = NftFirewall(options=node_policy(config), runner=recorder)  # type: ignore[arg-type]
    nft.apply(nft.plan(wanted, empty))
    (script,) = recorder.scripts
    entries = sum(len(found) for _, _, found in wanted.sets.values())
    classic, nftables = [], []
    for _ in range(repeat):
        with fresh_netns() as ns:
            classic.append(
                timed(lambda: in_ns(ns, "ipset", "restore", "-exist", input=sets, check=True))  # noqa: B023
                + timed(lambda: in_ns(ns, "iptables-restore", "--noflush", input=rules, check=True))  # noqa: B023
            )
        with fresh_netns() as ns:
            nftables.append(timed(lambda: in_ns(ns, "nft", "-f", "-", input=script, check=True)))  # noqa: B023
    a, b = statistics.median(classic), statistics.median(nftables)
    note = f"{entries} set entries"
    out.add("floor", "ipset restore + iptables-restore", a, a, note)
    out.add("floor", "nft -f (the same table)", b, b, note)
    return a, b


# ---- run --once ---------------------------------------------------------------------------


def run_once(manifest: Path, want: IpvsState, out: Results) -> float:
    """The console script in a fresh namespace; exit status and table checked."""
    with fresh_netns() as ns:
        args = agent_command(
            "--manifests", str(manifest), "--once", node=BENCH_NODE, service_cidr=SERVICE_CIDR,
            min_sync_period=None, health=None, metrics=None, more=NODE_FLAGS,
        )  # fmt: skip
        result: list[subprocess.CompletedProcess[str]] = []
        seconds = timed(lambda: result.append(in_ns(ns, *args, capture_output=True)))
        proc = result[0]
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            out.problem(f"run --once {manifest.name} exited {proc.returncode}: {tail}")
        if diff := same_table(ns, want):
            out.problem(f"run --once {manifest.name}: table differs from the floor's: {diff}")
    return seconds


def once_rows(
    big: Path, empty: Path, want: IpvsState, repeat: int, floor: float, out: Results
) -> None:
    bigs, empties = [], []
    # not counted: the boot's first process reads the interpreter and every module over the
    # VM's 9p share (a cold page cache; 2-3 s more than the runs after it)
    run_once(empty, IpvsState({}, {}), out)
    for _ in range(repeat):  # in turns: the VM's speed drifts
        empties.append(run_once(empty, IpvsState({}, {}), out))
        bigs.append(run_once(big, want, out))
        say(f"run --once: {bigs[-1]:.1f} s, empty {empties[-1]:.1f} s")
    b, e = statistics.median(bigs), statistics.median(empties)
    out.add("run --once", "S x D manifest, whole process", b, floor)
    out.add("run --once", "empty manifest (a Node)", e, floor)
    out.add("run --once", "marginal (difference)", b - e, floor, "target <= 0.50")
    # each big run right after its empty one: the VM's drift cancels within a pair
    pairs = [big - empty for big, empty in zip(bigs, empties, strict=True)]
    out.add(
        "run --once",
        "marginal (median of the pairs)",
        statistics.median(pairs),
        floor,
        "pairs " + " ".join(f"{p:.2f}" for p in pairs),
    )


# ---- the agent through the API ------------------------------------------------------------


SYNC_LINE = re.compile(r"^sync: ")


@dataclass
class SyncLine:
    seen: float  # when this process noticed the line (monotonic)
    msg: str

    def number(self, pattern: str) -> int | None:
        m = re.search(pattern, self.msg)
        return int(m.group(1)) if m else None

    @property
    def operations(self) -> int | None:
        return self.number(r"(\d+) operations")

    @property
    def failed(self) -> int | None:
        return self.number(r"\((\d+) failed\)")

    @property
    def firewall(self) -> int | None:
        return self.number(r"(\d+) firewall changes")

    @property
    def seconds(self) -> float | None:
        """The sync's duration: the `N.NNNs` before the `(full, ...)` suffix (the suffix has
        the firewall's share, `firewall N.NNNs`), else the last `N.NNNs` of the line."""
        m = re.search(r"(\d+\.\d+)s \(", self.msg)
        found = [m.group(1)] if m else re.findall(r"(\d+\.\d+)s\b", self.msg)
        return float(found[-1]) if found else None

    @property
    def kind(self) -> str:
        """What the agent says about the sync after its duration, e.g. `full, 1 Service changed`."""
        m = re.search(r"\d\.\d+s \((.*)\)$", self.msg)
        return m.group(1) if m else ""


class AgentLog:
    """The agent's JSON log lines, read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.syncs: list[SyncLine] = []
        self.errors: list[str] = []

    def poll(self) -> int:
        """Read what is new; the number of sync lines so far."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        now = time.monotonic()
        for raw in data[:end].splitlines():
            try:
                entry = json.loads(raw)
                msg, level = str(entry["msg"]), str(entry.get("level", ""))
            except (ValueError, KeyError, TypeError):
                msg, level = raw.decode(errors="replace"), "raw"
            if SYNC_LINE.match(msg):
                self.syncs.append(SyncLine(now, msg))
            elif level in ("error", "critical", "raw"):
                self.errors.append(msg)
        return len(self.syncs)

    def tail(self) -> str:
        return self.path.read_text(errors="replace")[-3000:]


class ProcIpvs:
    """/proc/net/ip_vs of a namespace, opened once (a proc file keeps the opener's netns)."""

    def __init__(self, ns: str) -> None:
        with inside(ns):
            self.fd = os.open("/proc/thread-self/net/ip_vs", os.O_RDONLY)
            # one virtual server's destinations over netlink: /proc prints the whole table,
            # seconds per reading at 50,000 virtual servers under emulation
            self.netlink = NetlinkKernel()

    def read(self) -> bytes:
        os.lseek(self.fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(self.fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)

    def counts(self) -> tuple[int, int]:
        """(virtual servers, real servers) now in the table."""
        text = self.read()
        dests = text.count(b"  -> ") - 1  # minus the header's "  -> RemoteAddress:Port"
        return text.count(b"\nTCP ") + text.count(b"\nUDP ") + text.count(b"\nSCTP "), dests

    def has(self, vip: str, port: int, dest: str, dest_port: int) -> bool:
        """Whether the virtual server TCP vip:port has that destination."""
        want = RSKey(IPv4Address(dest), dest_port)
        try:
            found = self.netlink.connections(VSKey(IPv4Address(vip), port, Proto.TCP))
        except KernelError:  # not there (yet)
            return False
        return want in found

    def close(self) -> None:
        os.close(self.fd)
        self.netlink.close()


def wait_for(check: Callable[[], bool], timeout: float, interval: float) -> float | None:
    """Monotonic time when `check` first held, None after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(interval)
    return None


@contextmanager
def api_server(ns: str, objects: list[RawObject]) -> Iterator[Any]:
    from tests.kubeapi import ApiServer  # trustme and cryptography: only for this part

    with inside(ns):  # the listening socket (and its serving threads) live in the namespace
        api = ApiServer(bookmark_interval=5.0, host="0.0.0.0")  # noqa: S104 - behind API_VIP too
        api.port = API_PORT
        api.start()
    try:
        for obj in objects:
            api.put(obj)
        yield api
    finally:
        api.stop()


class VipProbe:
    """TCP connections to a VIP from inside the agent's namespace, in a thread: every 50 ms
    until one completes its handshake through IPVS (`first`), then every `every` s, counting
    the attempts that fail after that (a Service that stopped answering)."""

    def __init__(self, ns: str, address: str, port: int, every: float = 0.25) -> None:
        self.ns, self.address, self.port, self.every = ns, address, port, every
        self.first: float | None = None
        self.attempts = self.failures = 0  # after `first`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="probe", daemon=True)

    def start(self) -> VipProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        with inside(self.ns):
            while not self._stop.is_set():
                ok = self._connects()
                if self.first is None:
                    self.first = time.monotonic() if ok else None
                else:
                    self.attempts += 1
                    self.failures += not ok
                self._stop.wait(0.05 if self.first is None else self.every)

    def _connects(self) -> bool:
        try:
            socket.create_connection((self.address, self.port), timeout=2.0).close()
            return True
        except OSError:
            return False

    def hold(self) -> ssl.SSLSocket:
        """A TLS connection to the VIP (the API server behind it), kept open by the caller."""
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with inside(self.ns):
            raw = socket.create_connection((self.address, self.port), timeout=30.0)
        return context.wrap_socket(raw)


def answers(held: ssl.SSLSocket) -> bool:
    """Whether a held connection to the API still answers a request."""
    try:
        held.sendall(b"GET /version HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n")
        return held.recv(64).startswith(b"HTTP/1.")
    except OSError:
        return False


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class AgentRun:
    ns: str
    log: AgentLog
    proc: subprocess.Popen[bytes]
    kernel: ProcIpvs
    cmd: list[str]
    probe: VipProbe | None = None  # the API's VIP (--api-service)
    changes: int = 0  # slice changes made so far (each one adds another pod)


def agent_rows(
    objects: list[RawObject],
    want: IpvsState,
    args: argparse.Namespace,
    floor: float,
    dump_floor: float,
    work: Path,
    out: Results,
) -> None:
    vss, rss = len(want.services), sum(len(d) for d in want.dests.values())
    with fresh_netns() as ns, api_server(ns, objects) as api:
        kubeconfig = api.write_kubeconfig(work / "kubeconfig")
        log_path = work / "agent.log"
        cmd = agent_command(
            "--kubeconfig", str(kubeconfig), netns=ns, node=BENCH_NODE, service_cidr=SERVICE_CIDR,
            min_sync_period=f"{args.min_sync_period}s", sync_period=args.sync_period,
            health=None, metrics=None, more=(*NODE_FLAGS, "--log-format", "json", "--v", "3"),
        )  # fmt: skip
        kernel = ProcIpvs(ns)
        say("agent: starting")
        probe = VipProbe(ns, API_VIP, 443) if args.api_service else None
        with log_path.open("wb") as sink:
            started = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=sink, stderr=sink)
        if probe is not None:
            probe.start()
        run = AgentRun(ns, AgentLog(log_path), proc, kernel, cmd, probe)
        try:
            _agent_measure(run, api, objects, want, (vss, rss), started, args, out)
            if run.proc.poll() is not None:
                out.problem(f"agent: exited {run.proc.returncode} during the measurements")
            elif "restart" in args.parts:
                restart_rows(run, work, args, out)
        finally:
            stop_agent(run.proc)
            if probe is not None:
                probe.stop()
            kernel.close()
            keep_logs(work, args.keep_logs)
    for row in out.rows:  # the first sync as a ratio to the floor
        if row.approach.startswith("first complete"):
            row.base = floor


def keep_logs(work: Path, into: Path | None) -> None:
    """The agents' logs (JSON lines, timestamped: each step of a pass can be attributed),
    copied out of the run's temporary directory."""
    if into is None:
        return
    try:
        into.mkdir(parents=True, exist_ok=True)
        for log_file in work.glob("agent*.log"):
            shutil.copyfile(log_file, into / log_file.name)
    except OSError as exc:  # the VM shares the host's files read-only but for --rwdir
        say(f"agent logs NOT kept: {exc} (scripts/bench-whole --keep-logs DIR passes --rwdir)")
        return
    say(f"agent logs kept in {into}")


def stop_agent(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _agent_measure(
    run: AgentRun,
    api: Any,
    objects: list[RawObject],
    want: IpvsState,
    counts: tuple[int, int],
    started: float,
    args: argparse.Namespace,
    out: Results,
) -> None:
    if not first_sync(run, want, counts, started, args, out):
        return
    if run.probe is not None:
        held = run.probe.hold()
        out.notes.append(f"the API through its VIP: {'answers' if answers(held) else 'SILENT'}")
        held.close()
    if args.first_change_after >= 0:  # the pass after the first one is an ordinary one
        early, _ = change_rounds(
            run, api, objects, args, out, rounds=1, settle=args.first_change_after, tag="first"
        )
        out.add(
            "agent", f"slice change {args.first_change_after:g} s after the first sync",
            early[0], None, f"target <= {args.min_sync_period + 1:.2f} s",
        )  # fmt: skip
    # after the first change (at 44,000 Services the dump and comparison take minutes under
    # emulation: the change would come during the next periodic full resync instead)
    if diff := same_table(run.ns, want, changed=run.changes):
        out.problem(f"agent: table differs from the floor's: {diff}")
    if idle_resync(run, args, out):
        latencies, durations = change_rounds(
            run, api, objects, args, out, rounds=args.repeat, settle=args.settle, tag="change"
        )
        if latencies:
            out.add(
                "agent", "one slice change -> in kernel", statistics.median(latencies), None,
                f"target <= {args.min_sync_period + 1:.2f} s (min-sync-period + 1 s)",
            )  # fmt: skip
        if durations:
            out.add(
                "agent", "event-driven sync, 1 Service (log)", statistics.median(durations),
                None, "target <= 0.05 s",
            )  # fmt: skip
    rss = peak_rss_mib(run.proc.pid)
    out.add("agent", "peak RSS (VmHWM), MiB", rss, None, "target <= 400 MB")
    run.log.poll()
    for error in run.log.errors:
        out.problem(f"agent logged: {error}")
    if args.show_syncs:
        out.notes += [f"sync at {s.seen - started:.1f} s: {s.msg}" for s in run.log.syncs]


def first_sync(
    run: AgentRun,
    want: IpvsState,
    counts: tuple[int, int],
    started: float,
    args: argparse.Namespace,
    out: Results,
) -> bool:
    """Process start -> the whole table in the kernel, then the first sync's log line."""

    done = until_counts(run, lambda got: got == counts, args.timeout)
    if done is None:
        out.problem(f"agent: table not complete within {args.timeout} s: {run.kernel.counts()}")
        return False
    out.add("agent", "first complete sync from start", done - started, None, "target <= 5.00")
    say(f"agent: table complete after {done - started:.1f} s")
    if wait_for(lambda: run.log.poll() > 0, args.timeout, 0.1) is None:
        out.problem("agent: no `sync: ...` log line after the first sync")
        return False
    first = run.log.syncs[0]
    out.add(
        "agent", "first sync: table, firewall, VIPs (log)", first.seen - started, None,
        "target <= 1.50 (ipvsadm -R + the firewall floors)",
    )  # fmt: skip
    if run.probe is not None and run.probe.first is not None:
        out.add("agent", "the API's VIP answers, from start", run.probe.first - started, None,
                "--first-services: before the whole table")  # fmt: skip
    elif run.probe is not None:
        out.problem("agent: the API's VIP did not answer by the end of the first sync")
    out.notes.append(f"agent's first sync line, {first.seen - started:.1f} s: {first.msg}")
    if first.failed:
        out.problem(f"agent: the first sync had failures: {first.msg}")
    return True


def until_counts(
    run: AgentRun, done: Callable[[tuple[int, int]], bool], timeout: float
) -> float | None:
    """Poll /proc/net/ip_vs until `done(counts)`: monotonic time then, None after `timeout`.
    Each reading is followed by a pause of four times what it took (at least 0.2 s): at
    50,000 virtual servers one reading takes seconds under emulation, and the bench must not
    take the agent's CPU."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            raise SystemExit(f"bench: the agent exited {run.proc.returncode}:\n{run.log.tail()}")
        before = time.monotonic()
        if done(run.kernel.counts()):
            return time.monotonic()
        time.sleep(max(0.2, 4 * (time.monotonic() - before)))
    return None


def idle_resync(run: AgentRun, args: argparse.Namespace, out: Results) -> bool:
    """Periodic resyncs with no change in between (`--idle` of them): the full syncs that
    come a sync period after the one before (a first sync longer than the period is
    followed by a full pass at once, which still re-reads everything the first one wrote:
    not idle). After each, `ipvsadm -S -n` dumps the agent's own table in its namespace:
    the ratio is of the two medians, measured side by side on the same table."""
    wait = args.sync_period * 4 + 60
    idles: list[SyncLine] = []
    dumps: list[float] = []
    cpu: list[tuple[float, float]] = []  # (when, the agent's CPU seconds) at each idle sync
    while len(idles) < args.idle:
        deadline = time.monotonic() + wait
        while True:
            before = run.log.poll()
            left = deadline - time.monotonic()
            if left <= 0 or wait_for(lambda: run.log.poll() > before, left, 0.25) is None:  # noqa: B023
                out.problem(f"agent: no periodic resync within {wait:.0f} s")
                return False
            prev, idle = run.log.syncs[before - 1], run.log.syncs[before]
            if idle.seen - prev.seen >= 0.8 * args.sync_period and idle.kind.startswith("full"):
                break
        if idle.operations != 0 or idle.firewall not in (0, None):
            out.problem(f"agent: the idle resync wrote something: {idle.msg}")
        idles.append(idle)
        cpu.append((idle.seen, process_cpu(run.proc.pid)))
        dumps.append(
            timed(lambda: in_ns(run.ns, "ipvsadm", "-S", "-n", capture_output=True, check=True))
        )
    seconds = statistics.median(i.seconds or 0.0 for i in idles)
    dump = statistics.median(dumps)
    note = f"{idles[-1].operations} operations, {idles[-1].firewall} firewall changes"
    note += f" ({idles[-1].kind})" if idles[-1].kind else ""
    out.add("agent", f"idle periodic resync (log), median of {len(idles)}", seconds, dump,
            note + "; target <= 0.30")  # fmt: skip
    out.add("agent", "ipvsadm -S -n of the agent's table, beside them", dump, dump)
    if len(cpu) >= 2:  # the agent's whole CPU between two idle resyncs: one sync period
        (t0, c0), (t1, c1) = cpu[0], cpu[-1]
        periods = (t1 - t0) / args.sync_period
        used = (c1 - c0) / periods
        share = f"{100 * used / args.sync_period:.1f} % of a core"
        out.add("agent", "idle: CPU s per sync period", used, None,
                f"{share}; target <= 2 % natively")  # fmt: skip
    return True


def restart_rows(run: AgentRun, work: Path, args: argparse.Namespace, out: Results) -> None:
    """SIGTERM, then a new agent on the complete table: its first pass writes nothing, the
    table never shrinks (polled), the API's VIP keeps answering (probed), and a connection
    held through the restart still works after it."""
    held = run.probe.hold() if run.probe is not None else None
    failures = run.probe.failures if run.probe is not None else 0
    counts = run.kernel.counts()  # the table as the changes left it
    code = stop_agent(run.proc)
    if code != 0:
        out.problem(f"agent: exited {code} on SIGTERM")
    if run.kernel.counts() != counts:
        out.problem(f"restart: the stopped agent left {run.kernel.counts()}, not {counts}")
    log_path = work / "agent-restarted.log"
    with log_path.open("wb") as sink:
        started = time.monotonic()
        run.proc = subprocess.Popen(run.cmd, stdout=sink, stderr=sink)
    run.log = AgentLog(log_path)
    fewest = [counts]

    def first_pass_done(got: tuple[int, int]) -> bool:
        fewest[0] = min(fewest[0], got)
        return run.log.poll() > 0

    done = until_counts(run, first_pass_done, args.timeout)
    if done is None:
        out.problem(f"restart: no first sync within {args.timeout} s")
        return
    line = run.log.syncs[0]
    wrote = f"{line.operations} operations, {line.firewall} firewall changes"
    out.add("restart", "first pass (log) from start", line.seen - started, None,
            f"{wrote}; target 0, 0")  # fmt: skip
    out.add("restart", "fewest virtual servers during it", fewest[0][0], None,
            f"{fewest[0][1]} real servers; of {counts[0]} / {counts[1]}")  # fmt: skip
    if line.operations or line.firewall:
        out.problem(f"restart: the first pass wrote something: {line.msg}")
    if fewest[0] != counts:
        out.problem(f"restart: the table shrank to {fewest[0]} during the first pass")
    if held is not None and run.probe is not None:
        alive = answers(held)
        held.close()
        lost = run.probe.failures - failures
        kept = "answers" if alive else "LOST"
        out.add("restart", "API VIP probes failed / held conn.", lost, None,
                f"of {run.probe.attempts} probes; held connection {kept}")  # fmt: skip
        if lost or not alive:
            out.problem(f"restart: {lost} probes failed, held connection alive: {alive}")
    if "first Services served" in log_path.read_text():
        out.problem("restart: the first Services were written again on a complete table")
    out.add("restart", "peak RSS (VmHWM), MiB", peak_rss_mib(run.proc.pid), None, "")


def change_rounds(
    run: AgentRun,
    api: Any,
    objects: list[RawObject],
    args: argparse.Namespace,
    out: Results,
    *,
    rounds: int,
    settle: float,
    tag: str,
) -> tuple[list[float], list[float]]:
    """`rounds` times, `settle` s after the last: one endpoint added to one Service's slice
    (each round another); kernel latency, sync time."""
    slices = {o["metadata"]["name"]: o for o in objects if o["kind"] == "EndpointSlice"}
    latencies: list[float] = []
    durations: list[float] = []
    for n in range(run.changes, run.changes + rounds):
        run.changes += 1
        i = _plain_service(args.services, n, args.load_balancer_every)
        name = f"svc-{i}-{i:05x}"  # its first slice
        changed = json.loads(json.dumps(slices[name]))
        new_pod = pod_ip(args.services * args.dests + n * NODES)  # a new pod on this node
        changed["endpoints"].append(
            {"addresses": [new_pod], "conditions": {"ready": True}, "nodeName": BENCH_NODE}
        )
        time.sleep(settle)  # away from the previous sync, as a change usually comes
        before = run.log.poll()
        start = time.monotonic()
        if tag == "first" and args.node_change:  # a change of this node's Node object first
            node = cluster_node(0)
            node["metadata"]["labels"] = {"kubernetes.io/bench-touched": str(n)}
            api.put(node)
        api.put(changed)
        seen = wait_for(
            lambda: run.kernel.has(cluster_ip(i), 80, new_pod, 8080),  # noqa: B023
            args.change_timeout,
            0.02,
        )
        if seen is None:
            out.problem(
                f"agent: the new endpoint {new_pod} of svc-{i} not in the kernel within "
                f"{args.change_timeout:g} s"
            )
            latencies.append(float("inf"))
            continue
        latencies.append(seen - start)
        wait_for(lambda: run.log.poll() > before, 60, 0.1)  # noqa: B023
        line = next((s for s in run.log.syncs[before:] if s.operations), None)
        if line is None or line.seconds is None:
            out.problem(f"agent: no sync line with operations after change {n + 1}")
        else:
            durations.append(line.seconds)
            out.notes.append(f"{tag} {n + 1}: in kernel after {seen - start:.3f} s; {line.msg}")
        slices[name] = changed
    return latencies, durations


def _plain_service(services: int, n: int, load_balancer_every: int) -> int:
    """A ClusterIP Service with one port, spread over the table."""
    i = (services // 2 + 7 * n) % services
    while i % TWO_PORTS_EVERY == 3 or is_node_port(i) or is_load_balancer(i, load_balancer_every):
        i = (i + 1) % services
    return i


# ---- main ---------------------------------------------------------------------------------


def print_table(out: Results, title: str) -> None:
    print(f"\n{title}")
    print(f"{'what':<11} {'approach':<46} {'seconds':>9}  {'ratio':>6}  note")
    for row in out.rows:
        secs = "n/a" if row.seconds is None else f"{row.seconds:.3f}"
        secs = "timeout" if row.seconds == float("inf") else secs
        ratio = "" if row.base is None or row.seconds is None else f"{row.seconds / row.base:.2f}"
        print(f"{row.what:<11} {row.approach:<46} {secs:>9}  {ratio:>6}  {row.note}")
    for note in out.notes:
        print(f"  {note}")
    for problem in out.problems:
        print(f"  PROBLEM: {problem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--dests", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement (median)")
    parser.add_argument("--floor-repeat", type=int, help="runs of each floor (default: --repeat)")
    parser.add_argument("--quick", action="store_true", help="smoke check: 100 Services")
    parser.add_argument(
        "--parts", default="floor,once,agent",
        help="any of floor,once,agent,restart (restart: after the agent rows; --api-service)",
    )  # fmt: skip
    parser.add_argument("--sync-period", type=float, default=15.0, help="the agent's, seconds")
    parser.add_argument("--min-sync-period", type=float, default=1.0, help="the agent's")
    parser.add_argument("--idle", type=int, default=3, help="idle resyncs measured (median)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before a change")
    parser.add_argument("--show-syncs", action="store_true", help="every sync line, at the end")
    parser.add_argument(
        "--node-change", action="store_true",
        help="the first change is preceded by a change of the agent's Node (every Service again)",
    )  # fmt: skip
    parser.add_argument(
        "--first-change-after", type=float, default=20.0,
        help="one slice change this many seconds after the first sync (-1: none)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600.0, help="for the first sync")
    parser.add_argument(
        "--firewall", default="auto", choices=("auto", "nftables", "iptables"), help="the agent's"
    )
    parser.add_argument("--change-timeout", type=float, default=300.0, help="for one change")
    parser.add_argument(
        "--load-balancer-every", type=int, default=0,
        help="one Service in N a LoadBalancer with an ingress IP (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--api-service", action="store_true",
        help="with default/kubernetes (-> the test API server) and kube-system/kube-dns: "
        "time until the API's VIP answers; parts `restart`: a restart on the complete table",
    )  # fmt: skip
    parser.add_argument(
        "--keep-logs",
        type=Path,
        help="copy the agents' logs (--v 3: each pass's steps; JSON) into this directory",
    )
    args = parser.parse_args()
    NODE_FLAGS.extend(("--firewall", args.firewall))
    if args.quick:
        args.services, args.sync_period = 100, 6.0
    parts = set(args.parts.split(","))
    args.parts = parts

    objects = cluster(args.services, args.dests, load_balancer_every=args.load_balancer_every)
    if args.api_service:
        objects += critical_services(node_ip(0), API_PORT)
    config = Config(
        node_name=BENCH_NODE, service_cidrs=parse_cidrs(SERVICE_CIDR, option="service-cidr")
    )
    desired, _ = from_objects(objects, config)
    want = IpvsState(desired.state.services, desired.state.dests)
    vss, rss = len(want.services), sum(len(d) for d in want.dests.values())
    out = Results()
    with tempfile.TemporaryDirectory(prefix="whole-path-") as tmp:
        work = Path(tmp)
        big = write_list(work / "big.json", objects)
        empty = write_list(work / "empty.json", [cluster_node(0)])
        megabytes = big.stat().st_size / 1e6
        say(f"{args.services}x{args.dests}: {vss} virtual, {rss} real servers")
        floor, dump_floor = 1.0, 1.0
        firewall_floor = 0.0
        if "floor" in parts or "once" in parts or "agent" in parts:
            floor_repeat = args.floor_repeat or args.repeat
            floor, dump_floor = floors(want, floor_repeat, out)
            say(f"floors: ipvsadm -R {floor:.2f} s, ipvsadm -S -n {dump_floor:.2f} s")
            firewall_floor, nft_floor = firewall_floors(objects, floor_repeat, out)
            say(f"firewall floors: ipset + iptables-restore {firewall_floor:.2f} s, "
                f"nft -f {nft_floor:.2f} s")  # fmt: skip
            out.add("floor", "ipvsadm -R + ipset + iptables-restore",
                    floor + firewall_floor, floor + firewall_floor)  # fmt: skip
        if "once" in parts:
            once_rows(big, empty, want, args.repeat, floor, out)
        if "agent" in parts:
            agent_rows(objects, want, args, floor, dump_floor, work, out)
            for row in out.rows:  # the whole first pass against the whole floor
                if row.approach.startswith("first sync: table, firewall"):
                    row.base = floor + firewall_floor
    print_table(
        out,
        f"ipvsproxy whole path, kernel {os.uname().release}, {args.services}x{args.dests} "
        f"({vss} virtual / {rss} real servers, {megabytes:.1f} MB of JSON), "
        f"median of {args.repeat}; agent: --sync-period {args.sync_period:g}s "
        f"--min-sync-period {args.min_sync_period:g}s --firewall {args.firewall}",
    )
    sys.exit(1 if out.problems else 0)


if __name__ == "__main__":
    main()
