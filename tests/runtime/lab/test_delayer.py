"""`runtime.lab.delayer`: packets held for their path's delay and written
back, others counted, stats on request, end of file stops it.

The TUN is stood in for by a SOCK_SEQPACKET socket pair (one read, one
packet, as on a TUN), so these run without root; the lab tests run the
real device.
"""

from __future__ import annotations

import json
import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from runtime.lab import delayer as delayer_module
from runtime.lab.delayer import Delayer, read_line
from runtime.lab.shaper import Shaper
from runtime.lab.topology import load_topology, make_plan

TOPOLOGY = load_topology(
    {"sites": [{"name": "a", "delay_ms": 10}, {"name": "b", "delay_ms": 20}, {"name": "c"}]}
)
WAIT_S = 2.0


def ipv4(src: str, dst: str, payload: bytes = b"x" * 8) -> bytes:
    header = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(payload), 0, 0, 64, 17, 0)
    return header + socket.inet_aton(src) + socket.inet_aton(dst) + payload


@dataclass
class Running:
    network: socket.socket
    """The kernel's side of the stand-in TUN: packets in, released ones out."""
    control: int
    stats: int
    delayer: Delayer
    thread: threading.Thread

    def received(self, timeout_s: float = WAIT_S) -> tuple[bytes, float] | None:
        if not select.select([self.network], [], [], timeout_s)[0]:
            return None
        return self.network.recv(65_536), time.monotonic()

    def ask_stats(self) -> dict[str, object]:
        os.write(self.control, b"stats\n")
        return json.loads(read_line(self.stats))


@pytest.fixture
def running() -> Iterator[Running]:
    network, tun = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control_read, control_write = os.pipe()
    stats_read, stats_write = os.pipe()
    plan = make_plan(TOPOLOGY, "labtest")
    shaper = Shaper(TOPOLOGY, random.Random(1))
    tun.setblocking(False)
    delayer = Delayer(tun.fileno(), plan, shaper)
    out = os.fdopen(stats_write, "w")
    thread = threading.Thread(target=delayer.serve, args=(control_read, out), daemon=True)
    thread.start()
    yield Running(network, control_write, stats_read, delayer, thread)
    os.close(control_write)  # end of file: serve returns
    thread.join(WAIT_S)
    assert not thread.is_alive()
    for fd in (control_read, stats_read):
        os.close(fd)
    out.close()
    network.close()
    tun.close()


def test_a_packet_comes_back_after_its_paths_delay(running: Running) -> None:
    packet = ipv4("10.77.1.2", "10.77.2.2")  # a's uplink 10 ms, b's downlink 20 ms
    sent = time.monotonic()
    running.network.send(packet)
    got = running.received()
    assert got is not None and got[0] == packet
    assert 0.030 - delayer_module.EARLY_S <= got[1] - sent < 0.030 + 0.025  # a loaded CI core


def test_packets_of_one_path_come_back_in_order(running: Running) -> None:
    packets = [ipv4("10.77.3.2", "10.77.1.2", bytes([i]) * 8) for i in range(50)]
    for packet in packets:
        running.network.send(packet)
    back = [running.received() for _ in packets]
    assert [got[0] for got in back if got] == packets


def test_what_cannot_be_routed_is_counted_not_sent(running: Running) -> None:
    for packet in (
        ipv4("10.77.1.2", "192.168.2.2"),  # a private address: no site's
        ipv4("10.1.1.1", "10.77.1.2"),  # from outside the lab
        b"\x60" + bytes(39),  # IPv6
        b"\x45\x00",  # too short
    ):
        running.network.send(packet)
    assert running.received(timeout_s=0.2) is None
    stats = running.ask_stats()
    assert stats["unroutable"] == 4 and stats["forwarded"] == 0


def test_stats_count_paths_and_lateness(running: Running) -> None:
    for _ in range(5):
        running.network.send(ipv4("10.77.1.2", "10.77.3.2"))
    for _ in range(5):
        assert running.received() is not None
    stats = running.ask_stats()
    assert stats["forwarded"] == 5 and stats["paths"] == {"a>c": {"sent": 5, "lost": 0}}
    lateness = stats["lateness_ms"]
    assert isinstance(lateness, dict) and 0 <= lateness["p50"] <= lateness["max"]


def test_a_full_hold_drops_and_counts(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    packet = ipv4("10.77.2.2", "10.77.1.2", b"y" * 1000)
    monkeypatch.setattr(delayer_module, "MAX_HELD_BYTES", 3 * len(packet))
    for _ in range(5):
        running.network.send(packet)
    assert sum(running.received() is not None for _ in range(3)) == 3
    assert running.received(timeout_s=0.2) is None
    assert running.ask_stats()["overflow"] == 2


def test_read_line_takes_one_line_only() -> None:
    read, write = os.pipe()
    os.write(write, b'{"x": 1}\nstats\n')
    assert read_line(read) == b'{"x": 1}'
    assert os.read(read, 100) == b"stats\n"
    os.close(read)
    os.close(write)


def test_a_bad_plan_exits_2_saying_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runtime.lab.delayer", "--tun", "nothing0"],
        input=b'{"prefix": "lab1", "topology": {"sites": []}}\n',
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert b"bad plan on stdin: sites: a lab needs at least one site" in done.stderr
