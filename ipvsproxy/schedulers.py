"""The kernel's IPVS schedulers, their flags, and what a Service may ask for.

Owns: the `Scheduler` names (as the kernel spells them), the scheduler flags
(`SCHED1`..`SCHED3` service flags, named per scheduler as `ipvsadm -b` names them), which
flags each scheduler accepts, the kernel module each needs, which schedulers honour weights,
how faithfully the iptables fallback can imitate each, and `resolve()`: a Service's
annotations -> a valid choice.

Imports: the standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

# Annotations a Service may carry to choose its own scheduler (node-wide default otherwise).
SCHEDULER_ANNOTATION = "ipvsproxy.io/scheduler"
FLAGS_ANNOTATION = "ipvsproxy.io/scheduler-flags"


class Scheduler(enum.StrEnum):
    """IPVS schedulers of the mainline kernel (net/netfilter/ipvs/ip_vs_*.c)."""

    RR = "rr"  # round robin
    WRR = "wrr"  # weighted round robin
    LC = "lc"  # least connections
    WLC = "wlc"  # weighted least connections
    LBLC = "lblc"  # locality-based least connections
    LBLCR = "lblcr"  # locality-based least connections with replication
    DH = "dh"  # destination hashing
    SH = "sh"  # source hashing
    SED = "sed"  # shortest expected delay
    NQ = "nq"  # never queue
    FO = "fo"  # weighted fail-over
    OVF = "ovf"  # weighted overflow
    MH = "mh"  # Maglev hashing
    TWOS = "twos"  # weighted random twos choice (kernel >= 6.2)

    @property
    def module(self) -> str:
        """The kernel module that provides this scheduler."""
        return f"ip_vs_{self.value}"

    @property
    def honours_weights(self) -> bool:
        """Whether a destination's weight above 0 changes its share of new connections
        (slow start needs it). rr, lc and dh skip weight-0 destinations and treat the
        others alike (ip_vs_rr.c, ip_vs_lc.c, ip_vs_dh.c); sh and mh fill their hash
        tables by weight (ip_vs_sh_reassign, ip_vs_mh_permutate)."""
        return self not in _WEIGHTLESS


_WEIGHTLESS = frozenset({Scheduler.RR, Scheduler.LC, Scheduler.DH})


class SchedFlag(enum.IntFlag):
    """The generic scheduler flags of a virtual service (linux/ip_vs.h IP_VS_SVC_F_SCHED*)."""

    SCHED1 = 0x0008
    SCHED2 = 0x0010
    SCHED3 = 0x0020


# Names `ipvsadm -b` accepts and prints, per scheduler; other schedulers take none.
_FLAG_NAMES: Mapping[Scheduler, Mapping[str, SchedFlag]] = {
    Scheduler.SH: {"sh-fallback": SchedFlag.SCHED1, "sh-port": SchedFlag.SCHED2},
    Scheduler.MH: {"mh-fallback": SchedFlag.SCHED1, "mh-port": SchedFlag.SCHED2},
}
_GENERIC_NAMES: Mapping[str, SchedFlag] = {
    "flag-1": SchedFlag.SCHED1,
    "flag-2": SchedFlag.SCHED2,
    "flag-3": SchedFlag.SCHED3,
}


class IptablesFidelity(enum.Enum):
    """How the iptables fallback imitates a scheduler."""

    EXACT = "exact"  # same distribution semantics
    APPROXIMATE = "approximate"  # same idea, different hash or counting
    RANDOM = "random"  # not expressible; random spread


IPTABLES_FIDELITY: Mapping[Scheduler, IptablesFidelity] = {
    s: IptablesFidelity.RANDOM for s in Scheduler
} | {
    Scheduler.RR: IptablesFidelity.EXACT,
    Scheduler.WRR: IptablesFidelity.APPROXIMATE,
    Scheduler.SH: IptablesFidelity.APPROXIMATE,
    Scheduler.DH: IptablesFidelity.APPROXIMATE,
}


# The flags a hashing scheduler gets unless a Service names its own. *-fallback: a client
# whose hash picks a destination at weight 0 (a removed endpoint draining its connections)
# is sent to the next one instead of refused, as the kernel refuses it without the flag
# (measured: integration/ipvs/test_hashing_drain.py). mh-port is kube-proxy's default for
# mh (FlagSourceHash): without it every connection of one client lands on one endpoint.
DEFAULT_FLAGS: Mapping[Scheduler, str] = {
    Scheduler.SH: "sh-fallback",
    Scheduler.MH: "mh-fallback,mh-port",
}


def allowed_flags(scheduler: Scheduler) -> Mapping[str, SchedFlag]:
    """The flag names this scheduler accepts (empty for most schedulers)."""
    return _FLAG_NAMES.get(scheduler, {})


def parse_flags(scheduler: Scheduler, text: str) -> SchedFlag:
    """Parse a comma-separated flag list as `ipvsadm -b` takes it; ValueError if invalid."""
    names = allowed_flags(scheduler)
    flags = SchedFlag(0)
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        flag = names.get(name)
        if flag is None:
            valid = ", ".join(names) or "none"
            raise ValueError(
                f"flag {name!r} is not valid for scheduler {scheduler} (valid: {valid})"
            )
        flags |= flag
    return flags


def parse_saved_flags(scheduler: Scheduler, text: str) -> SchedFlag:
    """Parse flags as `ipvsadm-save` prints them: named ones, or `flag-N` for other schedulers."""
    names = {**_GENERIC_NAMES, **allowed_flags(scheduler)}
    flags = SchedFlag(0)
    for name in filter(None, (part.strip() for part in text.split(","))):
        if name not in names:
            raise ValueError(f"unknown scheduler flag {name!r}")
        flags |= names[name]
    return flags


def format_flags(scheduler: Scheduler, flags: SchedFlag) -> str:
    """Flags as `ipvsadm -b` spells them for this scheduler ("" when none)."""
    names = allowed_flags(scheduler)
    parts = []
    for flag in (SchedFlag.SCHED1, SchedFlag.SCHED2, SchedFlag.SCHED3):
        if flags & flag:
            named = [n for n, f in names.items() if f == flag]
            parts.append(named[0] if named else f"flag-{flag.bit_length() - 3}")
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class Choice:
    """A Service's resolved scheduling: always valid; `warning` says what was ignored."""

    scheduler: Scheduler
    flags: SchedFlag = SchedFlag(0)
    warning: str = ""


def resolve(annotations: Mapping[str, str], default: Scheduler) -> Choice:
    """The scheduler a Service gets: its annotations if valid, else the node-wide default.

    An invalid annotation never breaks the Service: the result falls back to the default
    scheduler without flags and carries a warning naming the bad value.
    """
    raw_name = annotations.get(SCHEDULER_ANNOTATION)
    raw_flags = annotations.get(FLAGS_ANNOTATION)
    if raw_name is None and raw_flags is None and default not in DEFAULT_FLAGS:
        return Choice(default)  # most Services: parse_flags(default, "") is no flag
    raw_flags = raw_flags or ""
    scheduler = default
    if raw_name is not None:
        try:
            scheduler = Scheduler(raw_name.strip().lower())
        except ValueError:
            known = ", ".join(s.value for s in Scheduler)
            return Choice(
                default,
                warning=f"{SCHEDULER_ANNOTATION}={raw_name!r} is not an IPVS scheduler "
                f"(known: {known}); using the default {default}",
            )
    if FLAGS_ANNOTATION not in annotations:
        # an explicit flags annotation, even an empty one, replaces these
        raw_flags = DEFAULT_FLAGS.get(scheduler, "")
    try:
        flags = parse_flags(scheduler, raw_flags)
    except ValueError as exc:
        return Choice(
            default,
            warning=f"{FLAGS_ANNOTATION}={raw_flags!r}: {exc}; using the default {default}",
        )
    return Choice(scheduler, flags)
