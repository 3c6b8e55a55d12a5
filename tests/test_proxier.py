"""The one proxier with the firewall: full passes observe the host, partial passes only write.

FakeKernel for IPVS and tests.support's FakeHost for ipset/iptables (it fails like the
tools do). After every pass the host's sets equal what a from-scratch computation of the
final objects wants; a partial pass runs at most one `ipset restore` (and no observation).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import ip_address
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.firewall.sets import wanted
from ipvsproxy.model import BindAddress
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import OWN, ep, node, port, service, slice_, translate
from tests.strategies import foreign_states, states
from tests.support import FakeHost

CONFIG = Config(node_name="node-a")


def objects(n: int, *, moved: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [node()]
    for i in range(n):
        host = f"{i // 250}.{i % 250 + 1}"
        out.append(service(f"s{i}", cluster_ips=(f"10.96.{host}",)))
        here = "node-b" if moved and i == 0 else "node-a"
        endpoints = [ep(f"10.244.{host}", node=here), ep(f"10.245.{host}", node="node-b")]
        out.append(slice_(f"s{i}", endpoints=endpoints))
    return out


def host_wants(objs: list[dict[str, Any]]) -> dict[str, frozenset[str]]:
    desired = translate(*objs)
    sets = wanted(desired.state, desired.access, local=desired.local_endpoints)
    return {name: entries for name, (_, version, entries) in sets.sets.items() if version == 4}


def feed(tracker: Tracker, objs: list[dict[str, Any]]) -> None:
    for kind in (SERVICE, SLICE, NODE):
        tracker.replace(kind, [o for o in objs if o["kind"] == kind])


def test_full_then_partial_passes_keep_the_firewall_sets_exact_without_observing():
    host = FakeHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=CONFIG, firewall=firewall)
    tracker = Tracker(node_name="node-a")
    objs = objects(5)
    feed(tracker, objs)
    result = proxier.sync(tracker.take(), full=False)  # the first pass is full anyway
    assert result.full
    assert result.ok
    assert host.held() == host_wants(objs)
    assert "10.245.0.1,tcp:8080,10.245.0.1" not in host.held()["IPVSPROXY-LOOP-BACK"]

    # grow (sets swapped in), shrink, one more (in place), an endpoint leaving this node
    for step in (objects(6), objects(300), objects(120), objects(121), objects(4, moved=True)):
        host.ran.clear()
        feed(tracker, step)
        result = proxier.sync(tracker.take(), full=False)
        assert not result.full
        assert result.ok
        assert host.ran == [["ipset", "restore", "-exist"]]  # no list, no save, no iptables
        assert kernel.observations == 1
        assert host.held() == host_wants(step)

    host.ran.clear()
    result = proxier.sync(tracker.take(), full=False)  # nothing changed: nothing runs
    assert host.ran == []
    assert result.sync.plan == ()


class FailingHost(FakeHost):
    """FakeHost whose refusals come back as the tool's failure (Commands: KernelError)."""

    def run(self, args, *, stdin=None):
        try:
            return super().run(args, stdin=stdin)
        except (AssertionError, KeyError) as exc:
            raise KernelError(f"{args[0]} failed: {exc}") from exc


def test_a_failed_firewall_write_makes_the_next_pass_full():
    host = FailingHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    proxier = Proxier(kernel=FakeKernel(), config=CONFIG, firewall=firewall)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(2))
    proxier.sync(tracker.take(), full=True)
    del host.sets["IPVSPROXY-CLUSTER-IP"]  # someone destroys a set: the write fails
    feed(tracker, objects(3))
    result = proxier.sync(tracker.take(), full=False)
    assert result.firewall_error
    result = proxier.sync(tracker.take(), full=False)
    assert result.full  # observed again, and repaired
    assert result.ok
    assert host.held() == host_wants(objects(3))


class Ordered(FakeKernel):
    """A FakeKernel that records, in one list with the firewall's, when it reads and writes."""

    def __init__(self, firewall: Firewall) -> None:
        super().__init__()
        self.steps: list[str] = []
        observe, apply = firewall.observe, firewall.apply

        def observing() -> Any:
            self.steps.append("firewall read")
            return observe()

        def applying(plan: Any) -> None:
            self.steps.append("firewall wrote")
            apply(plan)

        firewall.observe, firewall.apply = observing, applying  # type: ignore[method-assign]

    def observe(self, *, access: Any = None) -> Any:
        self.steps.append("ipvs read")
        return super().observe(access=access)

    def apply(self, plan: Any, *, names: Any = None, access: Any = None) -> Any:
        binds = {op.__class__ is BindAddress for op in plan}
        self.steps.append({frozenset({True}): "ipvs bound"}.get(frozenset(binds), "ipvs wrote"))
        if True in binds and binds != {True}:
            self.steps.append("(binds with other operations)")
        return super().apply(plan, names=names, access=access)


def test_a_pass_writes_ipvs_then_the_firewall_then_binds_the_new_vips():
    """kube-proxy's order (the IPVS table, then the rules and sets), but a new VIP is bound
    last: it answers only once its virtual servers, destinations and firewall entries are
    in place. A partial pass reads nothing; one that binds nothing writes IPVS once."""
    host = FakeHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    kernel = Ordered(firewall)
    proxier = Proxier(kernel=kernel, config=CONFIG, firewall=firewall)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(3))
    result = proxier.sync(tracker.take(), full=True)
    assert kernel.steps == [
        "ipvs read",
        "firewall read",
        "ipvs wrote",
        "firewall wrote",
        "ipvs bound",
    ]
    assert result.ok
    assert result.firewall_changes
    assert host.held() == host_wants(objects(3))
    assert len(kernel.state.services) == 3
    assert len(kernel.state.bound) == 3
    assert sum(isinstance(op, BindAddress) for op in result.sync.plan) == 3  # all reported

    kernel.steps = []
    feed(tracker, objects(4))
    result = proxier.sync(tracker.take(), full=False)
    assert kernel.steps == ["ipvs wrote", "firewall wrote", "ipvs bound"]
    assert result.ok
    assert host.held() == host_wants(objects(4))

    kernel.steps = []
    feed(tracker, objects(3))  # one gone: its VIP unbound after its virtual server
    result = proxier.sync(tracker.take(), full=False)
    assert kernel.steps == ["ipvs wrote", "firewall wrote"]
    assert result.ok
    assert len(kernel.state.bound) == 3


def test_a_bind_the_kernel_refuses_is_reported_and_tried_again():
    """The binds, applied on their own after the firewall, still count in the pass's
    report: a refused one fails the pass and its address is looked at again."""
    host = FakeHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=CONFIG, firewall=firewall)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(2))
    kernel.errors = {BindAddress(ip_address("10.96.0.2")): KernelError("refused")}
    result = proxier.sync(tracker.take(), full=True)
    assert not result.ok
    assert [f.op for f in result.sync.report.failures] == [BindAddress(ip_address("10.96.0.2"))]
    assert proxier.ipvs.retry_addresses == {ip_address("10.96.0.2")}
    assert kernel.state.bound == {ip_address("10.96.0.1")}
    result = proxier.sync(tracker.take(), full=False)
    assert result.ok
    assert kernel.state.bound == {ip_address("10.96.0.1"), ip_address("10.96.0.2")}


class RefusingHost(FailingHost):
    refuse_restore = False

    def run(self, args, *, stdin=None):
        if self.refuse_restore and args[0] == "iptables-restore":
            raise KernelError("iptables-restore: refused")
        return super().run(args, stdin=stdin)


def test_a_failed_firewall_restore_in_a_full_pass_is_reported_with_its_ip_version():
    """The firewall's iptables-restore fails while the IPVS part is applied all the same;
    PassResult.restore_failed (kube-proxy's iptables_restore_failures_total) names its IP
    version; the next pass observes again. Any other firewall failure is an error but no
    restore failure."""
    host = RefusingHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    proxier = Proxier(kernel=FakeKernel(), config=CONFIG, firewall=firewall)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(2))
    host.refuse_restore = True
    result = proxier.sync(tracker.take(), full=True)
    assert "refused" in result.firewall_error
    assert result.restore_failed == (4,)
    assert len(proxier.kernel.observe().services) == 2
    host.refuse_restore = False
    result = proxier.sync(tracker.take(), full=False)
    assert result.full  # the host is unknown after the error: observed again
    assert result.ok

    del host.sets["IPVSPROXY-CLUSTER-IP"]  # the ipset write fails
    feed(tracker, objects(3))
    result = proxier.sync(tracker.take(), full=False)
    assert "ipset" in result.firewall_error
    assert result.restore_failed == ()


def test_the_fallback_failed_restore_counts_once_however_many_operations_it_carried():
    from ipvsproxy.fallback import IptablesKernel
    from tests.support import FakeIptables

    commands = FakeIptables()
    kernel = IptablesKernel(commands=commands)
    proxier = Proxier(kernel=kernel, config=CONFIG)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(3))
    commands.fail.add("iptables-restore")
    result = proxier.sync(tracker.take(), full=True)
    assert len(result.sync.report.failures) > 3
    assert result.restore_failed == (4,)
    result = proxier.sync(tracker.take(), full=True)  # the tool works again
    assert result.ok
    assert result.restore_failed == ()


@settings(max_examples=200, deadline=None)
@given(states(), states())
def test_the_table_advanced_by_a_plan_is_what_the_kernel_holds_after_it(before, after):
    """proxier.KnownTable (what partial passes plan against) follows every operation type as the
    kernel executes it (`model.transition`): from any state, a plan to any other."""
    from ipvsproxy.model import transition
    from ipvsproxy.proxier import KnownTable
    from ipvsproxy.sync.plan import plan

    ops = plan(after, before, ownership=OWN)
    table = KnownTable()
    seen = copy.deepcopy(before)
    table.seed(before)
    table.advance(ops)
    kernel = before
    for op in ops:
        kernel = transition(kernel, op)
    assert (table.services, table.dests, table.bound) == (
        dict(kernel.services),
        {key: dict(dests) for key, dests in kernel.dests.items()},
        set(kernel.bound),
    )
    assert before == seen  # the table shares its maps, and copies one before changing it
    again = copy.deepcopy(kernel)  # seeded again (a later full pass): nothing it owned stays
    table.seed(again)
    table.advance(plan(before, again, ownership=OWN))
    assert again == kernel


@settings(max_examples=100, deadline=None)
@given(states(), states())
def test_a_frozen_table_is_a_value_no_later_operation_reaches(before, after):
    """KnownTable.frozen() (what a pass publishes for `status`) is the table at the time it
    was taken, whatever is applied after; taken again, it is the same object until then."""
    from ipvsproxy.model import transition
    from ipvsproxy.proxier import KnownTable
    from ipvsproxy.sync.plan import plan

    table = KnownTable()
    table.seed(before)
    frozen = table.frozen()
    assert table.frozen() is frozen  # no copy while nothing changed
    seen = copy.deepcopy(frozen)
    ops = plan(after, before, ownership=OWN)
    table.advance(ops)
    assert frozen == seen
    kernel = before
    for op in ops:
        kernel = transition(kernel, op)
    now = table.frozen()
    assert (dict(now.services), {k: dict(d) for k, d in now.dests.items()}, now.bound) == (
        dict(kernel.services),
        {k: dict(d) for k, d in kernel.dests.items()},
        frozenset(kernel.bound),
    )
    assert (now is frozen) == (not ops)


# ---- refused operations: the table holds what the kernel took -----------------------------


def _table_of(proxier: Proxier) -> Any:
    table = proxier.table
    return table.services, table.dests, table.bound


def _kernel_of(kernel: FakeKernel) -> Any:
    state = kernel.observe()
    return (
        dict(state.services),
        {key: dict(dests) for key, dests in state.dests.items()},
        set(state.bound),
    )


@contextmanager
def refusing(objs: list[dict[str, Any]], refused: set[int]) -> Iterator[tuple[Any, ...]]:
    """(kernel, proxier, planned): a proxier fed `objs` with its full pass planned, the
    kernel refusing the operations at the indices in `refused`."""
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=CONFIG)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objs)
    proxier.feed(tracker.take())
    planned = proxier.plan(full=True)
    for index in refused:
        if index < len(planned.ipvs.plan):
            kernel.errors[planned.ipvs.plan[index]] = KernelError("refused")
    yield kernel, proxier, planned


@settings(max_examples=50, deadline=None)
@given(refused=st.sets(st.integers(0, 40), max_size=6))
def test_a_full_pass_with_refused_operations_records_only_what_the_kernel_took(refused):
    """The kernel refuses some: the table is what it holds."""
    with refusing(objects(4), refused) as (kernel, proxier, planned):
        result = proxier.apply(planned)
        assert result.sync.report.failures or not any(i < len(planned.ipvs.plan) for i in refused)
        assert _table_of(proxier) == _kernel_of(kernel)


def udp_objects(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [node()]
    for i in range(n):
        dns = [port("dns", 53, "UDP", 5353)]
        out.append(service(f"u{i}", cluster_ips=(f"10.96.1.{i + 1}",), ports=dns))
        endpoints = [ep(f"10.244.2.{i + 1}"), ep(f"10.244.3.{i + 1}")]
        out.append(slice_(f"u{i}", ports=(("dns", 5353, "UDP"),), endpoints=endpoints))
    return out


@settings(max_examples=50, deadline=None)
@given(refused=st.sets(st.integers(0, 30), max_size=6))
def test_the_udp_flows_to_forget_are_those_of_what_the_kernel_took(refused):
    """The UDP virtual servers that got a first endpoint the kernel did take
    (conntrack.udp_gone), whatever it refused."""
    from ipvsproxy.firewall.conntrack import udp_gone

    with refusing(udp_objects(4), refused) as (kernel, proxier, planned):
        ipvs = planned.ipvs
        done = proxier.ipvs.apply(planned, forget=True)
        gone = done.gone
        failed = {f.op for f in done.result.report.failures}
        assert gone == udp_gone(ipvs.plan, failed, before=ipvs.observed)
        assert len(gone) == len({key for key, _ in gone}) <= 4
        assert len(gone) == 4 or failed


@settings(max_examples=300, deadline=None)
@given(states(), foreign_states(), states(), st.booleans())
def test_the_table_advances_as_the_kernel_and_never_changes_what_it_was_seeded_from(
    ours, foreign, after, bound
):
    """Seeded from an observation and advanced by a plan's operations, from any state
    (someone else's virtual servers too) to any other, addresses managed or not, the table
    holds what the kernel then holds; the observation it shares maps with is unchanged."""
    from ipvsproxy.model import IpvsState
    from ipvsproxy.proxier import KnownTable
    from ipvsproxy.sync.plan import plan

    before = IpvsState(  # the foreign virtual servers' addresses not on our device
        {**foreign.services, **ours.services}, {**foreign.dests, **ours.dests}, ours.bound
    )
    kept = copy.deepcopy(before)
    ops = plan(after, before, ownership=OWN, manage_addresses=bound)
    table = KnownTable()
    table.seed(before)
    table.advance(ops)
    kernel = FakeKernel(copy.deepcopy(before))
    assert kernel.apply(ops).ok
    assert _table_of_table(table) == _kernel_of(kernel)
    assert before == kept


def _table_of_table(table: Any) -> Any:
    return (
        dict(table.services),
        {key: dict(dests) for key, dests in table.dests.items()},
        set(table.bound),
    )
