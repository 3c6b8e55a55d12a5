"""Checks of single field values that msgspec decoded with their JSON types already.

Owns: `Malformed` (a field not valid there, named), and the value checks the views' builders
share: ports, protocols, IP addresses, CIDRs, a shortened repr for messages.

Imports: model, the standard library.
"""

from __future__ import annotations

import reprlib
import sys
from collections.abc import Mapping
from ipaddress import IPv4Address, IPv6Address, ip_network
from socket import AF_INET, inet_pton

from ipvsproxy.api.views import KEPT_META_PREFIXES
from ipvsproxy.model import IPAddress, IPNetwork, Proto


class Malformed(ValueError):
    """A field of an API object is missing or holds a value not valid there.

    `field` is the path of the field at fault (`spec.ports[0].port`); the message starts with
    it. Raised by the views' builders only, and turned into a warning by api/validate.py.
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def missing(where: str) -> Malformed:
    return Malformed(f"{where} is missing", field=where)


def bad(where: str, value: object, problem: str) -> Malformed:
    """`where` holds a value of the right type that is not valid there."""
    return Malformed(f"{where} {shown(value)} {problem}", field=where)


def shown(value: object) -> str:
    """A value for a message, shortened: an object may carry a whole document, and YAML
    aliases can make a small file a tree of billions of nodes (repr() would never end)."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4


def kept(values: Mapping[str, str] | None) -> dict[str, str]:
    """The labels or annotations a view keeps (KEPT_META_PREFIXES)."""
    if not values:
        return {}
    return {k: v for k, v in values.items() if k.startswith(KEPT_META_PREFIXES)}


def port(value: int | None, where: str) -> int:
    if value is None or not 1 <= value <= 65535:
        raise bad(where, value, "is not a port number (1-65535)")
    return value


def proto(value: str | None, where: str) -> Proto:
    found = _PROTOS.get("TCP" if value is None else value)
    if found is None:
        raise bad(where, value, "is not TCP, UDP or SCTP")
    return found


_PROTOS = {p.name: p for p in Proto}


def ip(text: str | None, where: str) -> IPAddress:
    if text is not None:
        try:
            if ":" not in text:
                # inet_pton takes exactly what ipaddress takes for IPv4 (four decimal parts,
                # no leading zeros) in a fifth of the time of IPv4Address(text): every
                # endpoint of every slice passes here
                return IPv4Address(int.from_bytes(inet_pton(AF_INET, text), "big"))
            if "%" not in text:  # a scoped IPv6 address (fe80::1%eth0) is no Service address
                return IPv6Address(text)
        except (OSError, ValueError):  # UnicodeEncodeError (non-ASCII text) is a ValueError
            pass
    raise bad(where, text, "is not an IP address")


def cidr(text: str, where: str, *, strip: bool = False) -> IPNetwork:
    try:
        return ip_network(text.strip() if strip else text, strict=False)
    except ValueError:
        raise bad(where, text, "is not a CIDR") from None


def name(text: str) -> str:
    """A name many objects repeat (node names, zones): one string object for all of them."""
    return sys.intern(text)
