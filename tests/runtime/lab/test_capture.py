"""The lab's packet capture (`runtime.lab.capture`) on hand-made frames: each
TCP flow's bytes once, in order, whatever was retransmitted."""

from __future__ import annotations

import socket
import struct

from runtime.lab.capture import Capture


def frame(seq: int, payload: bytes, proto: int = socket.IPPROTO_TCP) -> bytes:
    """An Ethernet frame holding one IPv4 TCP segment 1.2.3.4:1 > 5.6.7.8:2."""
    tcp = struct.pack("!HHIIBBHHH", 1, 2, seq, 0, 5 << 4, 0, 0, 0, 0) + payload
    ip = bytes([0x45, 0]) + struct.pack("!H", 20 + len(tcp)) + bytes(5) + bytes([proto])
    ip += bytes(2) + socket.inet_aton("1.2.3.4") + socket.inet_aton("5.6.7.8")
    return bytes(12) + b"\x08\x00" + ip + tcp


def test_a_flow_is_its_bytes_once_in_order() -> None:
    capture = Capture()
    for seq, payload in ((100, b"abc"), (100, b"abc"), (101, b"bcdef"), (200, b"zz"), (106, b"g")):
        capture.packet(frame(seq, payload))
    capture.packet(frame(107, b"not tcp", proto=socket.IPPROTO_UDP))
    assert capture.to_json() == {"1.2.3.4:1>5.6.7.8:2": {"bytes": 7, "head": b"abcdefg".hex()}}


def test_sequence_numbers_wrap() -> None:
    capture = Capture()
    capture.packet(frame(2**32 - 2, b"ab"))
    capture.packet(frame(0, b"cd"))
    assert capture.to_json()["1.2.3.4:1>5.6.7.8:2"]["head"] == b"abcd".hex()
