"""The schedulers (schedulers.py): which kernel module each needs, their flags parsed,
formatted and checked per scheduler, the annotation and the node default resolved."""

from __future__ import annotations

import pytest

from ipvsproxy.schedulers import (
    IPTABLES_FIDELITY,
    Choice,
    SchedFlag,
    Scheduler,
    format_flags,
    parse_flags,
    parse_saved_flags,
    resolve,
)


def test_required_schedulers_and_modules():
    for name in (
        "rr",
        "lc",
        "dh",
        "sh",
        "sed",
        "nq",
        "wrr",
        "wlc",
        "lblc",
        "lblcr",
        "mh",
        "fo",
        "ovf",
    ):
        assert Scheduler(name).module == f"ip_vs_{name}"
    assert set(IPTABLES_FIDELITY) == set(Scheduler)


@pytest.mark.parametrize(
    ("sched", "text", "flags"),
    [
        (Scheduler.SH, "sh-fallback", SchedFlag.SCHED1),
        (Scheduler.SH, "sh-port,sh-fallback", SchedFlag.SCHED1 | SchedFlag.SCHED2),
        (Scheduler.MH, "mh-port", SchedFlag.SCHED2),
        (Scheduler.RR, "", SchedFlag(0)),
    ],
)
def test_flags_parse_and_format(sched, text, flags):
    assert parse_flags(sched, text) == flags
    assert parse_flags(sched, format_flags(sched, flags)) == flags


@pytest.mark.parametrize(("sched", "text"), [(Scheduler.RR, "sh-port"), (Scheduler.SH, "mh-port")])
def test_flags_of_another_scheduler_are_rejected(sched, text):
    with pytest.raises(ValueError, match=text):
        parse_flags(sched, text)


def test_generic_flag_names_of_saved_tables():
    assert parse_saved_flags(Scheduler.RR, "flag-1,flag-3") == SchedFlag.SCHED1 | SchedFlag.SCHED3
    assert format_flags(Scheduler.RR, SchedFlag.SCHED1 | SchedFlag.SCHED3) == "flag-1,flag-3"


def test_resolve_annotation_and_default():
    assert resolve({}, Scheduler.WLC).scheduler is Scheduler.WLC
    choice = resolve({"ipvsproxy.io/scheduler": " SH "}, Scheduler.RR)
    assert (choice.scheduler, choice.warning) == (Scheduler.SH, "")
    bad = resolve({"ipvsproxy.io/scheduler": "x"}, Scheduler.RR)
    assert bad.scheduler is Scheduler.RR
    assert "'x'" in bad.warning


def test_hashing_schedulers_fall_back_from_a_draining_destination_unless_flags_are_given():
    """sh and mh get their fallback flag (a drained endpoint's clients are sent on, not
    refused: integration/ipvs/test_hashing_drain.py), mh kube-proxy's mh-port too; any
    flags annotation, even an empty one, replaces them."""
    fallback, port = SchedFlag.SCHED1, SchedFlag.SCHED2
    assert resolve({}, Scheduler.MH) == Choice(Scheduler.MH, fallback | port)
    assert resolve({}, Scheduler.SH) == Choice(Scheduler.SH, fallback)
    assert resolve({"ipvsproxy.io/scheduler": "mh"}, Scheduler.RR).flags == fallback | port
    assert resolve({"ipvsproxy.io/scheduler": "sh"}, Scheduler.RR).flags == fallback
    explicit = {"ipvsproxy.io/scheduler": "mh", "ipvsproxy.io/scheduler-flags": "mh-port"}
    assert resolve(explicit, Scheduler.RR).flags == port
    none = {"ipvsproxy.io/scheduler-flags": ""}
    assert resolve(none, Scheduler.MH).flags == SchedFlag(0)
    assert resolve(none, Scheduler.SH).flags == SchedFlag(0)
    assert resolve({}, Scheduler.DH).flags == SchedFlag(0)  # no fallback flag to give
