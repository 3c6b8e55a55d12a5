"""Helpers shared by the unit and real-kernel tests (integration/ imports them too).

- `Synced` drives the product's own pass (proxier.Proxier, as `diff`, `run --once` and the
  agent do) from lists of raw objects, the way the agent's watchers feed it: through a Tracker.
- `Agent`, `driven_agent`, `next_run`: the agent's long-running pieces over FakeKernel (a
  runner on a fake clock in `driven_agent`); `sample`: one value of the agent's metrics.
- `eventually`, `Clock`, `free_port`: waiting for a thread or process, a fake clock, a port.
- `never_resolving`: a host name whose lookup blocks, as with a name server that never answers;
  `connecting`: the worker threads still making a connection (`kubeclient.Deadline.connect`).
- Fake `Commands` (the tools the firewall and the iptables fallback run): `FakeHost` (ipset
  in memory, empty iptables), `FakeIptables` (iptables tables held as text),
  `ScriptedCommands` (answers by argv prefix) and `RecordingCommands` (records, answers "").
- `ScriptedKernel`: a netlink socket answering batched requests like the kernel (an
  NLMSG_ERROR for every refused request, by its position, then the ack asked for).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ipvsproxy.agent_loop import AgentLoop
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.parse import target
from ipvsproxy.metrics import Metrics
from ipvsproxy.model import VSKey
from ipvsproxy.netlink import codec
from ipvsproxy.proxier import PassResult, Proxier
from ipvsproxy.serve import Health
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.runner import Runner
from ipvsproxy.sync.slowstart import SlowStart
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel


@dataclass
class Synced:
    """A proxier fed from lists of raw objects: each `sync()` hands over the whole list (what
    is missing from it is gone) and runs one pass."""

    proxier: Proxier
    tracker: Tracker = field(init=False)

    def __post_init__(self) -> None:
        self.tracker = Tracker(node_name=self.proxier.config.node_name)

    def feed(self, objects: Sequence[Mapping[str, Any]]) -> None:
        for kind in (SERVICE, SLICE, NODE):
            self.tracker.replace(kind, [o for o in objects if o.get("kind") == kind])

    def sync(self, objects: Sequence[Mapping[str, Any]], *, full: bool = True) -> PassResult:
        self.feed(objects)
        return self.proxier.sync(self.tracker.take(), full=full)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """One sample of the agent's metrics (0.0 when it was never recorded)."""
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


# ---- waiting, time, ports -------------------------------------------------------------------


def eventually(
    check: Callable[[], object],
    timeout: float = 10.0,
    what: str = "",
    *,
    interval: float = 0.02,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll `check` until it is true; fail after `timeout` seconds, saying `what` (or the
    check) and `detail()` (e.g. the logs)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"not within {timeout}s: {what or check}{more}")
        time.sleep(interval)


@contextmanager
def never_resolving(host: str) -> Iterator[list[str]]:
    """Inside: `socket.getaddrinfo` of `host` blocks (a name server that never answers) until
    the block ends, then fails as an unknown name; other names resolve. Yields the lookups of
    `host` made so far."""
    real, release, lookups = socket.getaddrinfo, threading.Event(), []

    def getaddrinfo(name: Any, *args: Any, **kwargs: Any) -> Any:
        if name != host:
            return real(name, *args, **kwargs)
        lookups.append(name)
        release.wait()
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]  # same call, looser types
    try:
        yield lookups
    finally:
        socket.getaddrinfo = real
        release.set()  # the lookups still blocked end (failing)


def connecting() -> list[threading.Thread]:
    """The threads still making a connection for `kubeclient.Deadline.connect`."""
    return [t for t in threading.enumerate() if t.name == "ipvsproxy-connect"]


class Clock:
    """A fake clock (a callable, as the runner, drainer and agent loop take it): no
    sleeping, exact times; tests move `now`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def free_port() -> int:
    """A TCP port free on 127.0.0.1 (of the current network namespace) just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the agent loop over FakeKernel -------------------------------------------------------


AGENT_CONFIG = Config(node_name="node-a", min_sync_period=0.0, sync_period=30.0)


def agent_proxier(
    kernel: FakeKernel, clock: Any = time.monotonic, config: Config = AGENT_CONFIG
) -> Proxier:
    """The agent's proxier (agent._proxier): draining removed endpoints, ramping new ones."""
    drainer = Drainer(timeout=config.drain_timeout, clock=clock)
    ramp = SlowStart(clock=clock)
    return Proxier(kernel=kernel, config=config, drainer=drainer, slow_start=ramp, clock=clock)


class Agent:
    """The agent's long-running pieces over FakeKernel: tracker, sync pass, metrics, health
    (the sync pass called directly, its runner never looping; `driven_agent` drives it).
    `on_names`: what the pass hands its Service names to (the --service-metrics collector
    registered on `metrics`, reading `kernel`)."""

    def __init__(
        self,
        *,
        metrics: Metrics | None = None,
        kernel: FakeKernel | None = None,
        on_names: Callable[[Mapping[VSKey, str]], None] | None = None,
        early: Tracker | None = None,
    ) -> None:
        self.changes: list[str] = []
        self.tracker = Tracker(on_change=self.changes.append, node_name=AGENT_CONFIG.node_name)
        self.kernel = kernel or FakeKernel()
        self.metrics = metrics or Metrics()
        self.health = Health(timeout=60)
        self.sync = AgentLoop(
            proxier=agent_proxier(self.kernel),
            tracker=self.tracker,
            metrics=self.metrics,
            health=self.health,
            on_names=on_names,
            early=early,
        )

    def feed(self, *objects) -> None:
        for kind in (SERVICE, SLICE):
            self.tracker.replace(kind, [o for o in objects if o["kind"] == kind])


def driven_agent(config: Config = AGENT_CONFIG) -> tuple[Agent, Runner, Clock]:
    """An agent whose sync pass is run by a real Runner on a fake clock, as in the agent."""
    clock = Clock(1000.0)  # one fake clock for the sync pass and its runner
    agent = Agent()
    agent.sync = AgentLoop(
        proxier=agent_proxier(agent.kernel, clock, config),
        tracker=agent.tracker,
        metrics=agent.metrics,
        health=agent.health,
        clock=clock,
    )
    return agent, agent.sync.runner, clock


def next_run(runner: Runner, clock: Clock) -> float:
    """Seconds from now until the runner's next run is due."""
    return runner.due(clock.now) - clock.now


# ---- fake Commands: the firewall's and the fallback's tools ---------------------------------

NUMBERS = {"6": "tcp", "17": "udp", "132": "sctp"}


class FakeHost:
    """ipset (restore scripts, list -n, save) in memory, and empty iptables: a fake that
    fails like the tool (create of an existing set, add over maxelem, del of a missing
    entry without -exist, swap of unlike sets)."""

    def __init__(self) -> None:
        self.sets: dict[str, tuple[str, int, int, set[str]]] = {}  # kind, version, maxelem
        self.ran: list[list[str]] = []
        self.prefix = ()

    def run(self, args, *, stdin=None):
        self.ran.append(list(args))
        if args[0] in {"iptables-save", "ip6tables-save", "conntrack"}:
            return ""
        if args[0] in {"iptables-restore", "ip6tables-restore"}:
            return ""
        if args[:3] == ["ipset", "list", "-n"]:
            return "".join(name + "\n" for name in self.sets)
        assert args[:2] == ["ipset", "restore"]
        out = []
        for line in (stdin or "").splitlines():
            out.append(self._line(line.split(), exist="-exist" in args))
        return "".join(out)

    def _line(self, words, *, exist):
        verb, name = words[0], words[1]
        if verb == "save":
            kind, version, maxelem, entries = self.sets[name]
            family = "inet" if version == 4 else "inet6"
            head = f"create {name} {kind} family {family} hashsize 1024 maxelem {maxelem}\n"
            return head + "".join(f"add {name} {e}\n" for e in sorted(entries))
        if verb == "create":
            options = dict(zip(words[3::2], words[4::2], strict=False))
            version = 4 if options["family"] == "inet" else 6
            shape = (words[2], version, int(options["maxelem"]))
            if name in self.sets:  # -exist: the same set again is no change
                assert exist, f"set {name} exists"
                assert self.sets[name][:3] == shape, f"set {name} exists with other parameters"
                return ""
            self.sets[name] = (*shape, set())
        elif verb == "destroy":
            assert exist or name in self.sets
            self.sets.pop(name, None)
        elif verb == "swap":
            a, b = self.sets[name], self.sets[words[2]]
            assert a[:2] == b[:2], "swap of unlike sets"
            self.sets[name], self.sets[words[2]] = b, a
        else:
            entry = words[2]
            address, _, rest = entry.partition(",")
            proto, colon, tail = rest.partition(":")
            if colon and proto in NUMBERS:
                entry = f"{address},{NUMBERS[proto]}:{tail}"
            kind, version, maxelem, entries = self.sets[name]
            if verb == "add":
                assert exist or entry not in entries
                entries.add(entry)
                assert len(entries) <= maxelem, "set is full"
            else:
                assert exist or entry in entries
                entries.discard(entry)
        return ""

    def held(self) -> dict[str, frozenset[str]]:
        return {name: frozenset(e) for name, (_, _, _, e) in self.sets.items()}


class ScriptedCommands:
    """Answers each command from a script (argv prefix -> output), records what ran."""

    def __init__(self, answers: Mapping[tuple[str, ...], str]) -> None:
        self.answers = answers
        self.ran: list[tuple[list[str], str | None]] = []
        self.prefix = ()

    def run(self, args, *, stdin=None):
        self.ran.append((list(args), stdin))
        for prefix, answer in self.answers.items():
            if tuple(args[: len(prefix)]) == prefix:
                return answer
        raise AssertionError(f"unexpected command {args}")


class RecordingCommands:
    """Records every command line (`ran`) and what it was fed (`fed`); answers ""."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []
        self.fed: list[tuple[list[str], str | None]] = []
        self.prefix = ()

    def run(self, args, *, stdin=None):
        self.ran.append(list(args))
        self.fed.append((list(args), stdin))
        return ""


SAVE = {"iptables-save": 4, "ip6tables-save": 6}
RESTORE = {"iptables-restore": 4, "ip6tables-restore": 6}
BUILTIN = ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")
FILTER_BUILTIN = ("INPUT", "FORWARD", "OUTPUT")


@dataclass(frozen=True)
class FakeIptables(Commands):
    """A scripted `Commands`: a nat table per family held as text (and a filter table, for
    IPVSPX-FORWARD), `iptables-save -t TABLE` printed from it and `iptables-restore --noflush`
    payloads executed on it (the subset ipvsproxy writes: chain declarations, -A, -I n, -D,
    -X), every call recorded."""

    tables: dict[int, dict[str, list[str]]] = field(
        default_factory=lambda: {v: {c: [] for c in BUILTIN} for v in (4, 6)}
    )
    filters: dict[int, dict[str, list[str]]] = field(
        default_factory=lambda: {v: {c: [] for c in FILTER_BUILTIN} for v in (4, 6)}
    )
    calls: list[tuple[str, str]] = field(default_factory=list)  # (tool, payload)
    fail: set[str] = field(default_factory=set)  # tools that refuse (once each)
    refusals: dict[str, int] = field(default_factory=dict)  # tool -> times it refuses in a row
    argv: list[tuple[str, ...]] = field(default_factory=list)  # every command line run

    def run(self, args, *, stdin=None) -> str:
        tool = args[0]
        self.calls.append((tool, stdin or ""))
        self.argv.append(tuple(args))
        if tool in self.fail:
            self.fail.discard(tool)
            raise KernelError(f"{tool} failed: scripted")
        if self.refusals.get(tool):
            self.refusals[tool] -= 1
            raise KernelError(f"{tool} failed: scripted")
        if tool in SAVE:
            table = args[args.index("-t") + 1] if "-t" in args else "nat"
            return self.save(SAVE[tool], table)
        self.restore(RESTORE[tool], stdin or "")
        return ""

    def save(self, version: int, table: str = "nat") -> str:
        chains = self.tables[version] if table == "nat" else self.filters[version]
        builtin = BUILTIN if table == "nat" else FILTER_BUILTIN
        lines = ["# Generated by scripted iptables-save", f"*{table}"]
        lines += [f":{c} ACCEPT [0:0]" for c in builtin]
        lines += [f":{c} - [0:0]" for c in sorted(chains) if c not in builtin]
        lines += [f"-A {c} {rule}" for c in builtin for rule in chains[c]]
        lines += [
            f"-A {c} {rule}" for c in sorted(chains) if c not in builtin for rule in chains[c]
        ]
        return "\n".join([*lines, "COMMIT", ""])

    def restore(self, version: int, payload: str) -> None:
        lines = payload.splitlines()
        assert lines[0] in ("*nat", "*filter"), payload
        assert lines[-1] == "COMMIT", payload
        tables = self.tables if lines[0] == "*nat" else self.filters
        chains = {c: list(rules) for c, rules in tables[version].items()}
        for line in lines:
            if line in ("*nat", "*filter", "COMMIT"):  # several transactions: _creation
                continue
            verb, _, rest = line.partition(" ")
            chain, _, spec = rest.partition(" ")
            if line.startswith(":"):
                chains[line[1:].split(" ", 1)[0]] = []
            elif verb == "-A":
                self._jump_target_exists(chains, spec)
                chains[chain].append(spec)
            elif verb == "-I":
                position, _, spec = spec.partition(" ")
                chains[chain].insert(int(position) - 1, spec)
            elif verb == "-D":
                chains[chain].remove(spec)
            elif verb == "-X":
                referenced = any(target(r) == chain for rules in chains.values() for r in rules)
                if referenced:  # as the kernel: the whole transaction is refused
                    raise KernelError(f"iptables-restore failed: CHAIN_DEL {chain} busy")
                del chains[chain]
            else:
                raise AssertionError(f"unexpected restore line {line!r}")
        tables[version] = chains

    @staticmethod
    def _jump_target_exists(chains: dict[str, list[str]], spec: str) -> None:
        into = target(spec)
        if into.startswith("IPVSPX-"):
            assert into in chains, f"jump to {into} before it exists"

    def tools(self) -> list[str]:
        return [tool for tool, _ in self.calls]

    def declared(self) -> set[str]:
        """Chains declared (created or flushed) by the restores recorded so far."""
        return {
            line[1:].split(" ", 1)[0]
            for tool, payload in self.calls
            if tool in RESTORE
            for line in payload.splitlines()
            if line.startswith(":")
        }


# ---- a scripted netlink socket (GenlSocket, RtnlSocket) ---------------------------------------


def error(seq: int, errno: int) -> bytes:
    """The kernel's NLMSG_ERROR (errno 0: the ack) for request `seq`."""
    return struct.pack("=IHHIIi", 36, codec.NLMSG_ERROR, 0, seq, 0, -errno) + bytes(16)


class ScriptedKernel:
    """`answer(position, type, payload)` is the errno of each request (0: done)."""

    def __init__(self, answer: Callable[[int, int, memoryview], int]) -> None:
        self.answer, self.seen = answer, 0
        self.sends: list[bytes] = []
        self._queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sends.append(data)
        replies = []
        for kind, flags, seq, payload in codec.messages(data):
            assert flags & codec.NLM_F_REQUEST
            code = self.answer(self.seen, kind, payload)
            self.seen += 1
            if code or flags & codec.NLM_F_ACK:
                replies.append(error(seq, code))
        self._queue.append(b"".join(replies))
        return len(data)

    def recv_into(self, buf: bytearray) -> int:
        data = self._queue.pop(0)
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        pass
