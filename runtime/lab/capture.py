"""A packet capture in a lab site: the TCP payload bytes seen on one interface, by flow.

The machine has no tcpdump, so this reads an `AF_PACKET` socket itself:
`python -m runtime.lab.capture IFACE OUT` run in a site's namespace (the
lab's `spawn`) keeps, for every TCP flow (one direction of a connection),
its byte count and its first `KEEP_BYTES` of payload, and writes them to
OUT as JSON on SIGTERM (or after `--seconds`). What a relay forwards can
then be checked byte for byte (`tests/processes/test_relays.py`: only
ZMTP with CURVE). Bounded: at most `MAX_FLOWS` flows are kept, each to
`KEEP_BYTES`; IPv4 over Ethernet only, which is what the lab builds.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Final

ETH_P_ALL: Final = 0x0003
ETH_HEADER: Final = 14
KEEP_BYTES: Final = 16 * 1024
"""Per flow: a ZMTP greeting and handshake are a few hundred bytes, a relay
reservation's lines a few hundred more; 16 KiB holds the start of every
message that matters and bounds memory."""
MAX_FLOWS: Final = 4096
"""A test's capture has tens of flows; more is a runaway, not data."""
READ_BYTES: Final = 65_536
POLL_S: Final = 0.2


class Capture:
    """Flows by `src:port>dst:port`: total bytes and the kept prefix, each
    byte once (a retransmitted segment adds nothing; one that arrives
    ahead of a gap is skipped, so the prefix is the stream as sent)."""

    def __init__(self) -> None:
        self.flows: dict[str, _Flow] = {}

    def packet(self, frame: bytes) -> None:
        """One Ethernet frame; anything but IPv4 TCP with payload is skipped."""
        if len(frame) < ETH_HEADER + 20 or frame[12:14] != b"\x08\x00":
            return
        ip = frame[ETH_HEADER:]
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        if ip[9] != socket.IPPROTO_TCP or len(ip) < ihl + 20:
            return
        tcp = ip[ihl:total]
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if not payload:
            return
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        key = f"{socket.inet_ntoa(ip[12:16])}:{sport}>{socket.inet_ntoa(ip[16:20])}:{dport}"
        flow = self.flows.get(key)
        if flow is None:
            if len(self.flows) >= MAX_FLOWS:
                return
            flow = self.flows[key] = _Flow(seq)
        flow.add(seq, payload)

    def to_json(self) -> dict[str, dict[str, object]]:
        return {key: {"bytes": f.count, "head": f.kept.hex()} for key, f in self.flows.items()}


class _Flow:
    """One direction of a connection, from the first payload seen."""

    def __init__(self, seq: int) -> None:
        self.next = seq
        self.count = 0
        self.kept = bytearray()

    def add(self, seq: int, payload: bytes) -> None:
        offset = (seq - self.next) % 2**32
        if offset >= 2**31:  # behind: a retransmission, maybe with new bytes at its end
            payload = payload[2**32 - offset :]
        elif offset > 0:
            return  # ahead of a gap
        self.next = (self.next + len(payload)) % 2**32
        self.count += len(payload)
        self.kept += payload[: max(0, KEEP_BYTES - len(self.kept))]


def run(interface: str, out: Path, seconds: float) -> None:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((interface, 0))
    sock.settimeout(POLL_S)
    capture = Capture()
    stop = False

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print(json.dumps({"ready": True}), flush=True)
    deadline = time.monotonic() + seconds
    while not stop and time.monotonic() < deadline:
        try:
            capture.packet(sock.recv(READ_BYTES))
        except TimeoutError:
            continue
    out.write_text(json.dumps(capture.to_json()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.lab.capture")
    parser.add_argument("interface")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, default=600.0)
    args = parser.parse_args(argv)
    run(args.interface, args.out, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
