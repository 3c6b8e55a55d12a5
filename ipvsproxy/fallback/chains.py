"""IPVS state -> ipvsproxy's own chains in the nat table, as `iptables-save` prints them (pure).

Owns: chain names, comment sanitising, and `render(state, names)`: the exact rule lines of
every chain ipvsproxy owns in one address family, in the canonical form `iptables-save`
prints (checked against iptables 1.8, legacy and nf_tables), so that rendered and observed
chains compare as text. The layout:

    PREROUTING, OUTPUT  -> IPVSPX-SERVICES      one rule per virtual server (destination
                                                address, protocol, port) -> its SVC chain,
                                                then one RETURN rule per VIP (the record of
                                                `IpvsState.bound`)
    IPVSPX-SVC-<h16>    per virtual server: session affinity (`recent`), then the
                        scheduler's choice among destinations of weight > 0 -> SEP
                        chains. For a LoadBalancer
                        frontend with loadBalancerSourceRanges it is the firewall instead
                        (kube-proxy's KUBE-FW-): one `-s RANGE -j IPVSPX-EXT-<h16>` per
                        range of its family, and the rest falls through un-DNATed, so no
                        other source ever reaches an endpoint (no range of the family: no
                        one does); IPVSPX-EXT-<h16> then holds the choice.
    IPVSPX-SVC-<h8>-<e8>  per destination ("SEP" chain): hairpin masquerade mark, the
                        masquerade mark the policy asks for, affinity record, DNAT to the
                        endpoint (weight-0 destinations keep their chain, unused)
    POSTROUTING         -> IPVSPX-POSTROUTING   masquerade what carries the mark, clear it
  filter table (`filter_ruleset()`, kube-proxy's KUBE-FORWARD, the same rules as the IPVS
  firewall's IPVSPROXY-FORWARD, from policy.forward_rules()):
    FORWARD             -> IPVSPX-FORWARD       INVALID dropped; marked packets and
                                                RELATED,ESTABLISHED flows accepted, so DNATed
                                                Service traffic passes a FORWARD policy DROP

Who is masqueraded and who may connect is the node's policy (ipvsproxy/policy.py, the same
the IPVS firewall renders): ClusterIP traffic from outside the pods (--cluster-cidr,
--detect-local-mode) or all of it (--masquerade-all); external traffic (NodePort,
externalIP, LoadBalancer) unless externalTrafficPolicy is Local; the mark bit is
--masquerade-bit. The nat table cannot DROP; kube-proxy also drops the un-DNATed rest in
the filter table, which this backend does not own.

Why a destination's chain is named after its virtual server's (`<h8>` = the first 8
characters of the SVC chain's hash): iptables-nft (1.8.7 and later) keeps every chain a
restore names in a sorted linked list, and each rule costs a walk to its chain's and its
jump target's place in it. With a Service's chains side by side in name order, and
`transaction()` writing them Service by Service in descending order, every walk is short:
loading 1000 Services x 10 endpoints went from 4.3 s to 0.23 s of `iptables-restore` user
time (measured: docs/performance.md#the-iptables-fallback). The fixed chains (SERVICES, POSTROUTING,
MARK-MASQ) sort before every hashed one, and SERVICES lists its virtual servers in
descending chain-name order for the same reason.

Schedulers, as close as iptables allows (see `schedulers.IPTABLES_FIDELITY`):
  rr   -> `statistic --mode nth`: exact round robin over new connections;
  sh   -> HMARK on the source address (plus source port with sh-port), one rule per
          destination matching the mark: one client address always lands on one backend;
  dh   -> HMARK on the destination address (a virtual server has one: one backend);
  every other scheduler -> `statistic --mode random`, by weight (wrr's weights hold on
          average, not per cycle; lc, sed, nq and the rest cannot count connections here).
The scheduler, flags, persistence timeout and weights are also written into rule comments,
so an observation reads them back exactly (the contract every backend keeps).

Comments carry the Service port's name, reduced to characters that cannot end a comment or
start another option: nothing from an API object reaches the rules otherwise.

Imports: iptables.transaction (Ruleset), model, policy, schedulers, the standard library.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ipvsproxy.iptables.transaction import Ruleset
from ipvsproxy.model import (
    IPAddress,
    IPNetwork,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
    addr_order,
    rs_order,
)
from ipvsproxy.policy import (
    DEFAULT_NODE,
    FrontendPolicy,
    Masquerade,
    NodePolicy,
    forward_rules,
    frontend_policy,
)
from ipvsproxy.schedulers import Scheduler

PREFIX = "IPVSPX-"
SERVICES = "IPVSPX-SERVICES"
POSTROUTING = "IPVSPX-POSTROUTING"
MARK_MASQ = "IPVSPX-MARK-MASQ"
SVC_PREFIX = "IPVSPX-SVC-"
FORWARD = "IPVSPX-FORWARD"  # in the filter table
EXT_PREFIX = "IPVSPX-EXT-"  # behind a firewalled SVC chain: what the allowed sources get
SEP_LENGTH = len(SVC_PREFIX) + 17
MASQ_BIT = 0x4000  # kube-proxy's masquerade bit (the default --masquerade-bit 14)
HMARK_SEED = 0x69707673  # "ipvs": any fixed value; a client must hash alike across syncs
VIP_COMMENT = "ipvsproxy vip"

# Jumps from the built-in chains (chain, rule spec), inserted at the top, once.
JUMPS: tuple[tuple[str, str], ...] = (
    ("PREROUTING", f'-m comment --comment "ipvsproxy service portals" -j {SERVICES}'),
    ("OUTPUT", f'-m comment --comment "ipvsproxy service portals" -j {SERVICES}'),
    ("POSTROUTING", f'-m comment --comment "ipvsproxy postrouting rules" -j {POSTROUTING}'),
)

# The filter table's jump, inserted at the top of FORWARD, once.
FILTER_JUMPS: tuple[tuple[str, str], ...] = (
    ("FORWARD", f'-m comment --comment "ipvsproxy forwarding rules" -j {FORWARD}'),
)

# Every chain name the renderer can make (and the previous layout's SEP chains, replaced by
# the first sync): ownership is by these exact names, never by prefix, so a chain of anyone
# else named IPVSPX-X (or IPVSPX-SVC-mine) is never read, flushed or deleted.
_HASH = "[A-Z2-7]"  # base32, as _hash() spells it
_HASHED = re.compile(
    rf"(?:{SVC_PREFIX}|{EXT_PREFIX}|IPVSPX-SEP-){_HASH}{{16}}|{SVC_PREFIX}{_HASH}{{8}}-{_HASH}{{8}}"
)


def owned(chain: str) -> bool:
    """Whether a nat-table chain is one ipvsproxy's renderer makes (exact names)."""
    return chain in (SERVICES, POSTROUTING, MARK_MASQ) or _HASHED.fullmatch(chain) is not None


def owned_filter(chain: str) -> bool:
    """Whether a filter-table chain is ipvsproxy's (the fallback has one there)."""
    return chain == FORWARD


_UNSAFE = re.compile(r"[^A-Za-z0-9._:/\[\]-]")
NAME_LIMIT = 160  # comments hold 256 bytes; the rest of ours is short


def sanitise(name: str) -> str:
    """A name safe inside a double-quoted comment and unambiguous to parse back: letters,
    digits and `._:/[]-` only (everything else becomes `_`), at most NAME_LIMIT long."""
    return _UNSAFE.sub("_", name)[:NAME_LIMIT] or "_"


def _hash(text: str) -> str:
    """16 base32 characters of SHA-256 (80 bits; only 10 bytes are encoded: b32encode is
    pure Python, and a render hashes every destination)."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()[:10]).decode()


def _ident(key: VSKey) -> str:
    return f"{key.proto.name}/{key.address}/{key.port}"


def svc_chain(key: VSKey) -> str:
    return SVC_PREFIX + _hash(_ident(key))


def sep_chain(key: VSKey, rs: RSKey) -> str:
    """The SEP chain starts with its SVC chain's prefix and 8 characters of its hash: an
    observation groups destinations by it (the weight-0 ones are referenced by no rule),
    and the chains of one virtual server sort side by side (see the module docstring)."""
    return _sep_chain(_hash(_ident(key)), _ident(key), rs)


def _sep_chain(svc_hash: str, ident: str, rs: RSKey) -> str:
    return f"{SVC_PREFIX}{svc_hash[:8]}-{_hash(f'{ident}|{rs.address}/{rs.port}')[:8]}"


def is_sep(chain: str) -> bool:
    return len(chain) == SEP_LENGTH and chain[SEP_LENGTH - 9] == "-"


def group_of(chain: str) -> str:
    """The 8 hash characters shared by a virtual server's SVC chain and its SEP chains."""
    return chain[len(SVC_PREFIX) : len(SVC_PREFIX) + 8]


def service_comment(name: str, vs: VirtualServer) -> str:
    return f"{name} sched={vs.scheduler} flags={int(vs.flags):#x} timeout={vs.timeout_s}"


def dest_comment(name: str, rs: RealServer) -> str:
    return f"{name} weight={rs.weight}"


def fixed(node: NodePolicy) -> Mapping[str, tuple[str, ...]]:
    """The chains every family has: the mark, and the masquerade of what carries it."""
    mark, bit = node.mark, node.bit
    return {
        MARK_MASQ: (f"-A {MARK_MASQ} -j MARK --set-xmark {mark}",),
        POSTROUTING: (
            f"-A {POSTROUTING} -m mark ! --mark {mark} -j RETURN",
            f"-A {POSTROUTING} -j MARK --set-xmark 0x0/{bit:#x}",
            f"-A {POSTROUTING} -j MASQUERADE --random-fully",
        ),
    }


FIXED = fixed(DEFAULT_NODE)


def filter_ruleset(node: NodePolicy = DEFAULT_NODE) -> Ruleset:
    """ipvsproxy's chain in one family's filter table (the same for both families; it never
    grows with Services): written with `transaction(saved, filter_ruleset(node),
    table="filter", jumps=FILTER_JUMPS)`, removed with `removal(saved, table="filter")`."""
    return Ruleset({FORWARD: forward_rules(FORWARD, node)})


@dataclass(frozen=True, slots=True)
class Piece:
    """What one virtual server contributes: its SERVICES rule (`dispatch`, sorted by
    `chain`, its SVC chain's name) and its own chains (SVC and SEP)."""

    chain: str
    dispatch: str
    chains: Mapping[str, tuple[str, ...]]


def render_service(
    vs: VirtualServer,
    dests: Iterable[RealServer],
    name: str,
    *,
    bound: bool,
    policy: FrontendPolicy | None = None,
    node: NodePolicy = DEFAULT_NODE,
) -> Piece:
    """One virtual server's chains; `bound`: its address is a VIP. `policy` (default: what
    `frontend_policy()` guesses from `bound`: a NodePort, every connection masqueraded so
    the reply comes back through this node, or a ClusterIP) and `node` decide the
    masquerade mark and the source-range firewall."""
    key = vs.key
    name = sanitise(name)
    ident = _ident(key)
    svc_hash = _hash(ident)
    chain = SVC_PREFIX + svc_hash
    proto = _proto(key.proto)
    dispatch = (
        f"-A {SERVICES} -d {_net(key.address)} -p {proto} "
        f'-m comment --comment "{service_comment(name, vs)}" '
        f"-m {proto} --dport {key.port} -j {chain}"
    )
    policy = policy or frontend_policy(None, bound=bound)
    ordered = sorted(dests, key=lambda rs: rs_order(rs.key))
    seps = [_sep_chain(svc_hash, ident, rs.key) for rs in ordered]
    version = key.address.version
    masquerade = _masquerade(policy, node, version)
    if policy.firewalled:
        ext = EXT_PREFIX + svc_hash
        chains = {
            chain: tuple(f"-A {chain} {_source(net)}-j {ext}" for net in policy.allowed(version)),
            ext: _svc_rules(vs, ext, ordered, seps),
        }
    else:
        chains = {chain: _svc_rules(vs, chain, ordered, seps)}
    for rs, sep in zip(ordered, seps, strict=True):
        chains[sep] = _sep_rules(vs, sep, rs, name, masquerade=masquerade)
    return Piece(chain, dispatch, chains)


def _masquerade(policy: FrontendPolicy, node: NodePolicy, version: int) -> str | None:
    """The match of the traffic to mark for masquerade ("" = all of it), or None."""
    match policy.masquerade:
        case Masquerade.ALWAYS:
            return ""
        case Masquerade.OUTSIDE:
            return node.cluster_ip_masquerade(version)
    return None


def _source(net: IPNetwork) -> str:
    """`-s NET ` as iptables-save prints it (nothing for /0, which matches everyone)."""
    return f"-s {net} " if net.prefixlen else ""


def services_chain(pieces: Iterable[Piece], vips: Iterable[IPAddress]) -> tuple[str, ...]:
    """The SERVICES chain: one rule per virtual server, in descending chain-name order
    (cheap for iptables-nft to load, see the module docstring), then one RETURN per VIP."""
    dispatch = [p.dispatch for p in sorted(pieces, key=lambda p: p.chain, reverse=True)]
    return (
        *dispatch,
        *(
            f'-A {SERVICES} -d {_net(address)} -m comment --comment "{VIP_COMMENT}" -j RETURN'
            for address in sorted(vips, key=addr_order)
        ),
    )


def render(
    state: IpvsState,
    names: Mapping[VSKey, str],
    *,
    version: int,
    policies: Mapping[VSKey, FrontendPolicy] | None = None,
    node: NodePolicy = DEFAULT_NODE,
) -> Ruleset:
    """Every chain ipvsproxy owns for the virtual servers of one IP version (4 or 6)."""
    policies = policies or {}
    pieces = [
        render_service(
            vs,
            state.dests.get(key, {}).values(),
            names.get(key) or str(key),
            bound=key.address in state.bound,
            policy=policies.get(key),
            node=node,
        )
        for key, vs in state.services.items()
        if key.address.version == version
    ]
    chains = dict(fixed(node))
    for piece in pieces:
        chains.update(piece.chains)
    vips = (a for a in state.bound if a.version == version)
    chains[SERVICES] = services_chain(pieces, vips)
    return Ruleset(chains)


def _svc_rules(
    vs: VirtualServer, chain: str, dests: list[RealServer], all_seps: list[str]
) -> tuple[str, ...]:
    active = [rs for rs in dests if rs.weight > 0]
    seps = [sep for rs, sep in zip(dests, all_seps, strict=True) if rs.weight > 0]
    rules: list[str] = []
    if vs.flags & ServiceFlags.PERSISTENT:
        mask = _full_mask(vs.key.address)
        age = f"--seconds {vs.timeout_s} --reap " if vs.timeout_s else ""
        rules += [
            f"-A {chain} -m recent --rcheck {age}--name {sep} --mask {mask} --rsource -j {sep}"
            for sep in seps
        ]
    if len(seps) == 1:
        rules.append(f"-A {chain} -j {seps[0]}")
    elif seps and vs.scheduler is Scheduler.RR:
        n = len(seps)
        rules += [
            f"-A {chain} -m statistic --mode nth --every {n - i} --packet 0 -j {sep}"
            for i, sep in enumerate(seps[:-1])
        ]
        rules.append(f"-A {chain} -j {seps[-1]}")
    elif seps and vs.scheduler in (Scheduler.SH, Scheduler.DH):
        rules.append(f"-A {chain} -j HMARK {_hmark(vs, len(seps))}")
        rules += [f"-A {chain} -m mark --mark {i + 1:#x} -j {sep}" for i, sep in enumerate(seps)]
    elif seps:
        weights = [rs.weight for rs in active]
        for i, sep in enumerate(seps[:-1]):
            p = _probability(weights[i] / sum(weights[i:]))
            rules.append(f"-A {chain} -m statistic --mode random --probability {p} -j {sep}")
        rules.append(f"-A {chain} -j {seps[-1]}")
    return tuple(rules)


def _sep_rules(
    vs: VirtualServer, chain: str, rs: RealServer, name: str, *, masquerade: str | None
) -> tuple[str, ...]:
    """The mark goes here, after the scheduler's choice, not in the SVC chain: HMARK (sh,
    dh) overwrites the whole packet mark, and its choice matches the mark exactly."""
    proto = _proto(vs.key.proto)
    rules = [f"-A {chain} -s {_net(rs.key.address)} -j {MARK_MASQ}"]  # hairpin
    if masquerade is not None:  # "" = every connection, else those the match selects
        rules.append(f"-A {chain} {masquerade}-j {MARK_MASQ}")
    if vs.flags & ServiceFlags.PERSISTENT:
        mask = _full_mask(vs.key.address)
        rules.append(f"-A {chain} -m recent --set --name {chain} --mask {mask} --rsource")
    rules.append(
        f'-A {chain} -p {proto} -m comment --comment "{dest_comment(name, rs)}" '
        f"-j DNAT --to-destination {_host_port(rs.key)}"
    )
    return tuple(rules)


def _hmark(vs: VirtualServer, n: int) -> str:
    bits = 32 if vs.key.address.version == 4 else 128
    if vs.scheduler is Scheduler.DH:
        tuple_ = f"--hmark-dst-prefix {bits}"
    else:
        tuple_ = f"--hmark-src-prefix {bits}"
        if vs.flags & ServiceFlags.SCHED2:  # sh-port: hash the source port too
            tuple_ += " --hmark-sport-mask 0xffff"
    return f"{tuple_} --hmark-rnd {HMARK_SEED:#x} --hmark-mod {n} --hmark-offset 1"


def _probability(p: float) -> str:
    """As the statistic match stores (p * 2^31, rounded) and iptables-save prints it."""
    raw = int(p * 0x80000000 + 0.5)
    return f"{raw / 0x80000000:.11f}"


def _host_port(key: RSKey) -> str:
    address = str(key.address)  # str(), not an f-string: ipaddress's __format__ is slow
    return f"{address}:{key.port}" if key.address.version == 4 else f"[{address}]:{key.port}"


def _net(address: IPAddress) -> str:
    return str(address) + ("/32" if address.version == 4 else "/128")


def _full_mask(address: IPAddress) -> str:
    return "255.255.255.255" if address.version == 4 else "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"


def _proto(proto: Proto) -> str:
    return proto.name.lower()
