"""The one pipeline with the companion: full passes observe the host, partial passes only write.

FakeKernel for IPVS and the companion tests' FakeHost for ipset/iptables (it fails like the
tools do). After every pass the host's sets equal what a from-scratch computation of the
final objects wants; a partial pass runs at most one `ipset restore` (and no observation).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy import pipeline as pipeline_module
from ipvsproxy.companion.kernel import Companion
from ipvsproxy.companion.sets import wanted
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.pipeline import Pipeline
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.companion.test_scale import FakeHost
from tests.factories import ep, node, port, service, slice_, translate
from tests.strategies import foreign_states, states
from tests.sync.test_plan import OWN

CONFIG = Config(node_name="node-a")


def objects(n: int, *, moved: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [node()]
    for i in range(n):
        out.append(service(f"s{i}", cluster_ips=(f"10.96.0.{i + 1}",)))
        here = "node-b" if moved and i == 0 else "node-a"
        endpoints = [ep(f"10.244.0.{i + 1}", node=here), ep(f"10.244.1.{i + 1}", node="node-b")]
        out.append(slice_(f"s{i}", endpoints=endpoints))
    return out


def host_wants(objs: list[dict[str, Any]]) -> dict[str, frozenset[str]]:
    desired = translate(*objs)
    sets = wanted(desired.state, desired.access, local=desired.local_endpoints)
    return {name: entries for name, (_, version, entries) in sets.sets.items() if version == 4}


def feed(tracker: Tracker, objs: list[dict[str, Any]]) -> None:
    for kind in (SERVICE, SLICE, NODE):
        tracker.replace(kind, [o for o in objs if o["kind"] == kind])


def test_full_then_partial_passes_keep_the_companion_sets_exact_without_observing():
    host = FakeHost()
    companion = Companion(commands=host, versions=(4,))  # type: ignore[arg-type]
    kernel = FakeKernel()
    pipeline = Pipeline(kernel=kernel, config=CONFIG, companion=companion)
    tracker = Tracker(node_name="node-a")
    objs = objects(5)
    feed(tracker, objs)
    result = pipeline.sync(tracker.take(), full=False)  # the first pass is full anyway
    assert result.full
    assert result.ok
    assert host.held() == host_wants(objs)
    assert "10.244.1.1,tcp:8080,10.244.1.1" not in host.held()["IPVSPROXY-LOOP-BACK"]

    for step in (objects(6), objects(4), objects(4, moved=True)):
        host.ran.clear()
        feed(tracker, step)
        result = pipeline.sync(tracker.take(), full=False)
        assert not result.full
        assert result.ok
        assert host.ran == [["ipset", "restore", "-exist"]]  # no list, no save, no iptables
        assert kernel.observations == 1
        assert host.held() == host_wants(step)

    host.ran.clear()
    result = pipeline.sync(tracker.take(), full=False)  # nothing changed: nothing runs
    assert host.ran == []
    assert result.sync.plan == ()


class FailingHost(FakeHost):
    """FakeHost whose refusals come back as the tool's failure (Commands: KernelError)."""

    def run(self, args, *, stdin=None):
        try:
            return super().run(args, stdin=stdin)
        except (AssertionError, KeyError) as exc:
            raise KernelError(f"{args[0]} failed: {exc}") from exc


def test_a_failed_companion_write_makes_the_next_pass_full():
    host = FailingHost()
    companion = Companion(commands=host, versions=(4,))  # type: ignore[arg-type]
    pipeline = Pipeline(kernel=FakeKernel(), config=CONFIG, companion=companion)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(2))
    pipeline.sync(tracker.take(), full=True)
    del host.sets["IPVSPROXY-CLUSTER-IP"]  # someone destroys a set: the write fails
    feed(tracker, objects(3))
    result = pipeline.sync(tracker.take(), full=False)
    assert result.companion_error
    result = pipeline.sync(tracker.take(), full=False)
    assert result.full  # observed again, and repaired
    assert result.ok
    assert host.held() == host_wants(objects(3))


class Meeting(FakeKernel):
    """A FakeKernel that, when asked to, reads and writes only once the companion has started
    reading or writing too (a pipeline doing one after the other makes it wait in vain)."""

    def __init__(self, companion: Companion) -> None:
        super().__init__()
        self.meet = True
        self.met: list[str] = []
        self.reading, self.writing = threading.Event(), threading.Event()
        observe, apply = companion.observe, companion.apply

        def observing() -> Any:
            self.reading.set()
            return observe()

        def applying(plan: Any) -> None:
            self.writing.set()
            apply(plan)

        companion.observe, companion.apply = observing, applying  # type: ignore[method-assign]

    def observe(self) -> Any:
        if self.meet:
            self.met.append("read" if self.reading.wait(WAIT) else "read alone")
        return super().observe()

    def apply(self, plan: Any, *, names: Any = None) -> Any:
        if self.meet:
            self.met.append("wrote" if self.writing.wait(WAIT) else "wrote alone")
        else:
            self.met.append("wrote first" if not self.writing.is_set() else "wrote after")
        return super().apply(plan, names=names)


WAIT = 5.0  # seconds; reached only when the pipeline does not overlap the two


def test_a_full_pass_reads_and_writes_ipvs_and_the_companion_together():
    """A full pass's IPVS and companion steps overlap (overlap.py); a partial pass's IPVS
    writes come first, as kube-proxy's order. Every result as in one after the other."""
    host = FakeHost()
    companion = Companion(commands=host, versions=(4,))  # type: ignore[arg-type]
    kernel = Meeting(companion)
    pipeline = Pipeline(kernel=kernel, config=CONFIG, companion=companion)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(3))
    result = pipeline.sync(tracker.take(), full=True)
    assert kernel.met == ["read", "wrote"]
    assert result.ok
    assert result.companion_changes
    assert host.held() == host_wants(objects(3))
    assert len(kernel.state.services) == 3

    kernel.meet, kernel.met = False, []
    kernel.writing.clear()
    feed(tracker, objects(4))
    result = pipeline.sync(tracker.take(), full=False)
    assert kernel.met == ["wrote first"]
    assert result.ok
    assert host.held() == host_wants(objects(4))


class RefusingHost(FailingHost):
    refuse_restore = False

    def run(self, args, *, stdin=None):
        if self.refuse_restore and args[0] == "iptables-restore":
            raise KernelError("iptables-restore: refused")
        return super().run(args, stdin=stdin)


def test_a_failed_companion_restore_in_a_full_pass_is_reported_with_its_ip_version():
    """The companion's iptables-restore fails while the IPVS part is applied all the same;
    PassResult.restore_failed (kube-proxy's iptables_restore_failures_total) names its IP
    version; the next pass observes again. Any other companion failure is an error but no
    restore failure."""
    host = RefusingHost()
    companion = Companion(commands=host, versions=(4,))  # type: ignore[arg-type]
    pipeline = Pipeline(kernel=FakeKernel(), config=CONFIG, companion=companion)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(2))
    host.refuse_restore = True
    result = pipeline.sync(tracker.take(), full=True)
    assert "refused" in result.companion_error
    assert result.restore_failed == (4,)
    assert len(pipeline.kernel.observe().services) == 2
    host.refuse_restore = False
    result = pipeline.sync(tracker.take(), full=False)
    assert result.full  # the host is unknown after the error: observed again
    assert result.ok

    del host.sets["IPVSPROXY-CLUSTER-IP"]  # the ipset write fails
    feed(tracker, objects(3))
    result = pipeline.sync(tracker.take(), full=False)
    assert "ipset" in result.companion_error
    assert result.restore_failed == ()


def test_the_fallback_failed_restore_counts_once_however_many_operations_it_carried():
    from ipvsproxy.iptables import IptablesKernel
    from tests.iptables.fake import ScriptedCommands

    commands = ScriptedCommands()
    kernel = IptablesKernel(commands=commands)
    pipeline = Pipeline(kernel=kernel, config=CONFIG)
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(3))
    commands.fail.add("iptables-restore")
    result = pipeline.sync(tracker.take(), full=True)
    assert len(result.sync.report.failures) > 3
    assert result.restore_failed == (4,)
    result = pipeline.sync(tracker.take(), full=True)  # the tool works again
    assert result.ok
    assert result.restore_failed == ()


@settings(max_examples=200, deadline=None)
@given(states(), states())
def test_the_table_advanced_by_a_plan_is_what_the_kernel_holds_after_it(before, after):
    """pipeline.Table (what partial passes plan against) follows every operation type as the
    kernel executes it (`model.transition`): from any state, a plan to any other."""
    from ipvsproxy.model import transition
    from ipvsproxy.pipeline import Table
    from ipvsproxy.sync.plan import plan

    ops = plan(after, before, ownership=OWN)
    table = Table()
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


# ---- a large full pass: the table recorded while the operations go out ---------------------


class WaitsForRecording(FakeKernel):
    """A FakeKernel whose apply waits until the pipeline has started recording the plan in
    its table (a pipeline recording after the write makes it wait in vain)."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = threading.Event()
        self.met: list[str] = []

    def apply(self, plan: Any, *, names: Any = None) -> Any:
        self.met.append("alongside" if self.recording.wait(WAIT) else "alone")
        return super().apply(plan, names=names)


def _table_of(pipeline: Pipeline) -> Any:
    table = pipeline.table
    return table.services, table.dests, table.bound


def _kernel_of(kernel: FakeKernel) -> Any:
    state = kernel.observe()
    return (
        dict(state.services),
        {key: dict(dests) for key, dests in state.dests.items()},
        set(state.bound),
    )


def test_a_large_full_pass_records_its_table_while_the_operations_go_out(monkeypatch):
    monkeypatch.setattr(pipeline_module, "OPTIMISTIC_RECORD", 1)
    kernel = WaitsForRecording()
    pipeline = Pipeline(kernel=kernel, config=CONFIG)
    settle = pipeline.table.settle

    def recording(*args: Any) -> None:
        kernel.recording.set()
        settle(*args)

    pipeline.table.settle = recording  # type: ignore[method-assign, assignment]
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(3))
    assert pipeline.sync(tracker.take(), full=True).ok
    assert kernel.met == ["alongside"]
    assert _table_of(pipeline) == _kernel_of(kernel)


@contextmanager
def refusing(objs: list[dict[str, Any]], refused: set[int]) -> Iterator[tuple[Any, ...]]:
    """(kernel, pipeline, planned): a pipeline fed `objs` with its full pass planned, the
    kernel refusing the operations at the indices in `refused`, every pass recording its
    table while it writes (OPTIMISTIC_RECORD 1)."""
    pipeline_module.OPTIMISTIC_RECORD, was = 1, pipeline_module.OPTIMISTIC_RECORD
    try:
        kernel = FakeKernel()
        pipeline = Pipeline(kernel=kernel, config=CONFIG)
        tracker = Tracker(node_name="node-a")
        feed(tracker, objs)
        pipeline.feed(tracker.take())
        planned = pipeline.plan(full=True)
        for index in refused:
            if index < len(planned.ipvs.plan):
                kernel.errors[planned.ipvs.plan[index]] = KernelError("refused")
        yield kernel, pipeline, planned
    finally:
        pipeline_module.OPTIMISTIC_RECORD = was


@settings(max_examples=50, deadline=None)
@given(refused=st.sets(st.integers(0, 40), max_size=6))
def test_a_full_pass_with_refused_operations_records_only_what_the_kernel_took(refused):
    """Recorded while written, then the kernel refuses some: the table is what it holds."""
    with refusing(objects(4), refused) as (kernel, pipeline, planned):
        result = pipeline.apply(planned)
        assert result.sync.report.failures or not any(i < len(planned.ipvs.plan) for i in refused)
        assert _table_of(pipeline) == _kernel_of(kernel)


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
    """Found while a large full pass is written, then again where the kernel refused any:
    the UDP virtual servers that got a first endpoint it did take (conntrack.udp_gone)."""
    from ipvsproxy.companion.conntrack import udp_gone
    from ipvsproxy.sync.engine import apply_pass

    with refusing(udp_objects(4), refused) as (kernel, pipeline, planned):
        ipvs = planned.ipvs
        pipeline.table.seed(ipvs.observed)
        result, failed, gone = pipeline._written(
            lambda: apply_pass(kernel, ipvs, names={}), ipvs, full=True, forget=True
        )
        assert failed == {f.op for f in result.report.failures}
        assert gone == udp_gone(ipvs.plan, failed, before=ipvs.observed)
        assert len(gone) == len({key for key, _ in gone}) <= 4
        assert len(gone) == 4 or failed


# ---- a full pass: the host read while the changes are translated ---------------------------


class WaitsForFeed(FakeKernel):
    """A FakeKernel whose observation and the pipeline's translation wait for each other to
    start (a pipeline reading before or after translating makes one wait in vain)."""

    def __init__(self) -> None:
        super().__init__()
        self.feeding, self.observing = threading.Event(), threading.Event()
        self.met: list[str] = []

    def observe(self) -> Any:
        self.observing.set()
        self.met.append("alongside" if self.feeding.wait(WAIT) else "alone")
        return super().observe()


def test_a_full_pass_reads_the_host_while_the_changes_are_translated():
    kernel = WaitsForFeed()
    host = FakeHost()
    pipeline = Pipeline(kernel=kernel, config=CONFIG, companion=Companion(commands=host))  # type: ignore[arg-type]
    fed = pipeline.feed

    def feeding(changes: Any) -> None:
        kernel.feeding.set()
        kernel.met.append("fed alongside" if kernel.observing.wait(WAIT) else "fed alone")
        fed(changes)

    pipeline.feed = feeding  # type: ignore[method-assign]
    tracker = Tracker(node_name="node-a")
    feed(tracker, objects(3))
    planned = pipeline.plan_from(tracker.take(), full=True)
    assert sorted(kernel.met) == ["alongside", "fed alongside"]
    # the plan `plan()` makes after the same feed, companion included
    other = Companion(commands=FakeHost())  # type: ignore[arg-type]
    again = Pipeline(kernel=FakeKernel(), config=CONFIG, companion=other)
    feed(tracker, objects(3))
    again.feed(tracker.take(everything=True))
    expected = again.plan(full=True)
    assert planned.ipvs.plan == expected.ipvs.plan
    assert planned.companion == expected.companion
    assert planned.companion is not None
    assert pipeline.apply(planned).ok
    kernel.met.clear()  # a partial pass reads nothing while it translates
    kernel.observing.set()
    assert pipeline.sync(tracker.take(), full=False).ok
    assert kernel.met == ["fed alongside"]


@settings(max_examples=300, deadline=None)
@given(states(), foreign_states(), states(), st.booleans())
def test_a_full_pass_taken_whole_settles_the_table_as_its_operations_would(
    ours, foreign, after, bound
):
    """Table.settle (a full pass the kernel took whole) leaves exactly the table that
    seeding from the observation and advancing by each operation leaves, from any state
    (someone else's virtual servers too) to any other, addresses managed or not; each
    planned destination is the planned object."""
    from ipvsproxy.model import IpvsState
    from ipvsproxy.pipeline import Table
    from ipvsproxy.sync.plan import plan

    before = IpvsState(  # the foreign virtual servers' addresses not on our device
        {**foreign.services, **ours.services}, {**foreign.dests, **ours.dests}, ours.bound
    )
    ops = plan(after, before, ownership=OWN, manage_addresses=bound)
    advanced, settled = Table(), Table()
    advanced.seed(before)
    advanced.advance(ops)
    settled.settle(before, after, ops)
    assert (settled.services, settled.dests, settled.bound) == (
        advanced.services,
        advanced.dests,
        advanced.bound,
    )
    for key, dests in after.dests.items():
        assert all(settled.dests[key][rs] is server for rs, server in dests.items())
    planned = copy.deepcopy(after)
    settled.advance(plan(ours, after, ownership=OWN, manage_addresses=bound))  # and back
    assert after == planned  # what it shares with the plan stays as it was
