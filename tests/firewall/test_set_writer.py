"""SetWriter without a kernel: its messages byte for byte (as `ipset restore -exist` v7.17
sends them, taken with strace), the ADT batching, errors named by set and entry."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.host_firewall import Firewall, FirewallPlan
from ipvsproxy.firewall.ipset import SetChange, SetCommand, set_commands
from ipvsproxy.firewall.set_reader import _attrs
from ipvsproxy.firewall.set_writer import ADT_BYTES, SetWriter, encode_entry

HEADER = struct.Struct("=IHHII")
CREATE, DESTROY, SWAP, ADD, DEL, TYPE = 2, 3, 6, 9, 10, 13


def message(command: int, flags: int, seq: int, attrs: str) -> bytes:
    body = bytes.fromhex("02000000" + "05000100 07000000" + attrs.replace(" ", ""))
    return HEADER.pack(16 + len(body), 0x600 | command, flags, seq, 0) + body


class ScriptedSocket:
    """Answers each request as the kernel does: TYPE with revision 7 (min 0), the others
    with an ack, or `errors[(command, lineno or 0)]` (an ADT error echoes the request with
    the refused entry's number in its IPSET_ATTR_LINENO)."""

    def __init__(self, errors: dict[tuple[int, int], int] | None = None) -> None:
        self.sent: list[bytes] = []
        self.errors = errors or {}
        self.queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        at = 0
        while at < len(data):
            size, kind, _, seq, _ = HEADER.unpack_from(data, at)
            self.queue.append(self._answer(kind & 0xFF, seq, data[at : at + size]))
            at += size
        return len(data)

    def recv(self, _: int) -> bytes:
        out, self.queue = b"".join(self.queue), []
        return out

    def recv_into(self, buf: bytearray | memoryview) -> int:
        out = self.recv(len(buf))
        buf[: len(out)] = out
        return len(out)

    def _answer(self, command: int, seq: int, request: bytes) -> bytes:
        if command == TYPE:
            attrs = bytes.fromhex("02000000 05000400 07000000 05000a00 00000000")
            reply = HEADER.pack(16 + len(attrs), 0x600 | TYPE, 0, seq, 0) + attrs
            return reply + ack(seq, 0, b"")
        for (wanted, lineno), code in self.errors.items():
            if wanted != command:
                continue
            if lineno == 0:
                return ack(seq, code, request)
            entries = dict(_attrs(request[20:]))[8]
            if lineno <= len(list(_attrs(entries))):
                echoed = request.replace(  # the kernel writes the refused entry's number
                    lineno_attr(len(list(_attrs(entries)))), lineno_attr(lineno), 1
                )
                return ack(seq, code, echoed)
        return ack(seq, 0, request[:16])


def lineno_attr(number: int) -> bytes:
    return struct.pack("=HH", 8, 0x4009) + struct.pack("!I", number)


def ack(seq: int, code: int, request: bytes) -> bytes:
    body = struct.pack("=i", -code) + request
    return HEADER.pack(16 + len(body), 2, 0, seq, 0) + body


def writer(sock: ScriptedSocket) -> SetWriter:
    """A SetWriter whose netlink socket talks to `sock` instead of the kernel."""
    made = SetWriter()
    made._nl._sock.close()
    made._nl._sock = sock  # type: ignore[assignment]
    return made


def test_create_is_the_message_ipset_restore_sends():
    sock = ScriptedSocket()
    create = SetCommand("create", "IPVSPROXY-X", "hash:ip,port", 4, 1024, 65536)
    assert writer(sock).write([create]) == 1
    assert len(sock.sent) == 2  # the revision asked once (IPSET_CMD_TYPE), then the create
    assert sock.sent[1] == message(
        CREATE,
        0x405,  # NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE, no NLM_F_EXCL: -exist
        2,
        "10000200 49505653 50524f58 592d5800"  # IPVSPROXY-X
        "11000300 68617368 3a69702c 706f7274 00000000"  # hash:ip,port
        "05000400 07000000 05000500 02000000"  # revision 7, AF_INET
        "14000780 08001240 00000400 08001340 00010000",  # hashsize 1024, maxelem 65536
    )


def test_add_is_the_message_ipset_restore_sends():
    sock = ScriptedSocket()
    add = SetCommand("add", "IPVSPROXY-X", entries=("10.0.0.1,tcp:80", "10.0.0.2,udp:53"))
    writer(sock).write([add])
    entry = "28000780 0c000180 08000140 {ip} 06000440 {port} 0000 05000700 {proto} 000000"
    assert sock.sent[0] == message(
        ADD,
        0x5,
        1,
        "10000200 49505653 50524f58 592d5800 08000940 00000002 54000880"
        + entry.format(ip="0a000001", port="0050", proto="06")
        + "08000940 00000001"
        + entry.format(ip="0a000002", port="0035", proto="11")
        + "08000940 00000002",
    )


def test_entries_of_every_type_and_family_encode_as_the_tool_encodes_them():
    # the DATA payloads of `add IPVSPROXY-Y fd00::1,132:80,fd01::/64` (hash:ip,port,net)
    # and `add IPVSPROXY-B 10.0.0.1,6:80,10.0.0.1` (hash:ip,port,ip), lineno left out
    v6 = "18000180 14000240 fd000000 00000000 00000000 00000001 06000440 00500000 05000700 84000000"
    v6 += "18001480 14000240 fd010000 00000000 00000000 00000000 05001500 40000000"
    assert encode_entry("fd00::1,sctp:80,fd01::/64") == bytes.fromhex(v6.replace(" ", ""))
    v4 = "0c000180 08000140 0a000001 06000440 00500000 05000700 06000000"
    v4 += "0c001480 08000140 0a000001"
    assert encode_entry("10.0.0.1,tcp:80,10.0.0.1") == bytes.fromhex(v4.replace(" ", ""))
    assert encode_entry("10.0.0.1,6:80,10.0.0.1") == encode_entry("10.0.0.1,tcp:80,10.0.0.1")
    assert encode_entry("10.0.0.1") == bytes.fromhex("0c000180080001400a000001")


def test_many_entries_go_in_few_messages_and_sends_each_entry_numbered_once():
    sock = ScriptedSocket()
    entries = tuple(
        f"10.1.{i // 250}.{i % 250},tcp:{i % 9 + 1},10.1.{i // 250}.1" for i in range(10000)
    )
    sends = writer(sock).write([SetCommand("add", "IPVSPROXY-LOOP-BACK", entries=entries)])
    messages = []
    for data in sock.sent:
        at = 0
        while at < len(data):
            size = HEADER.unpack_from(data, at)[0]
            messages.append(data[at : at + size])
            at += size
    assert sends == len(sock.sent) <= 8
    seen = []
    for one in messages:
        attrs = dict(_attrs(one[20:]))
        assert len(attrs[8]) <= ADT_BYTES
        numbers = [struct.unpack("!I", dict(_attrs(d))[9])[0] for _, d in _attrs(attrs[8])]
        assert numbers == list(range(1, len(numbers) + 1))
        seen += numbers
    assert len(seen) == 10000
    assert len(messages) < 30


def test_what_was_sent_before_a_swap_is_acknowledged_first():
    sock = ScriptedSocket()
    wanted = frozenset(f"10.0.0.{i}" for i in range(100))
    change = SetChange("IPVSPROXY-VIPS", "hash:ip", 4, wanted=wanted, rebuild=True)
    writer(sock).write(set_commands([change]))
    assert [HEADER.unpack_from(data)[1] & 0xFF for data in sock.sent] == [TYPE, DESTROY, SWAP]


def test_a_refused_entry_is_named_with_its_set_and_nothing_after_it_is_sent():
    sock = ScriptedSocket(errors={(ADD, 2): 4352})  # IPSET_ERR_HASH_FULL
    wanted = frozenset(f"10.0.0.{i}" for i in range(100))
    commands = set_commands(
        [SetChange("IPVSPROXY-VIPS", "hash:ip", 4, wanted=wanted, rebuild=True)]
    )
    second = sorted(wanted, key=list(wanted).index)[1]
    with pytest.raises(KernelError, match=f"ipset add IPVSPROXY-VIPS-T {second}: the set is full"):
        writer(sock).write(commands)
    assert SWAP not in [HEADER.unpack_from(data)[1] & 0xFF for data in sock.sent]


def test_a_refused_create_is_named_and_a_missing_set_destroyed_is_not_an_error():
    sock = ScriptedSocket(errors={(DESTROY, 0): 2})  # ENOENT: -exist ignores it
    writer(sock).write([SetCommand("destroy", "IPVSPROXY-GONE")])
    sock = ScriptedSocket(errors={(CREATE, 0): 4103})
    create = SetCommand("create", "IPVSPROXY-X", "hash:ip", 4, 1024, 65536)
    with pytest.raises(KernelError, match="ipset create IPVSPROXY-X: already exists"):
        writer(sock).write([create])


class RecordingWriter:
    def __init__(self) -> None:
        self.written: list[list[SetCommand]] = []

    def write(self, commands: list[SetCommand]) -> int:
        self.written.append(list(commands))
        return 1


class NoProcess:
    def run(self, args: list[str], stdin: str | None = None) -> str:
        assert args[0] != "ipset", "the writer writes the sets"
        return ""


def test_a_firewall_with_a_writer_runs_no_ipset_process():
    recording = RecordingWriter()
    firewall = Firewall(commands=NoProcess(), writer=recording)  # type: ignore[arg-type]
    change = SetChange("IPVSPROXY-VIPS", "hash:ip", 4, create=True, add=("10.0.0.1",))
    firewall.apply(FirewallPlan(sets=(change,), stale_sets=("IPVSPROXY-OLD",)))
    assert firewall.write_sets([change]) == 2
    assert recording.written == [
        set_commands([change]),
        [SetCommand("destroy", "IPVSPROXY-OLD")],
        set_commands([change]),
    ]


V4 = st.ip_addresses(v=4).map(str)


@given(V4, st.sampled_from(["tcp", "udp", "sctp"]), st.integers(0, 65535), st.none() | V4)
def test_an_entry_decodes_back_to_its_text(address, proto, port, second):
    """What the writer encodes, the reader decodes to the same `ipset save` text."""
    from ipvsproxy.firewall.set_reader import decode_entry

    text = f"{address},{proto}:{port}" + (f",{second}" if second is not None else "")
    assert decode_entry(encode_entry(text)) == text
