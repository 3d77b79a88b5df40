"""The lab's userspace delayer: the core's packets held for their link's delay.

This kernel has no `tc netem`, so delay, jitter and loss are done here: one
process in the core namespace reads every IPv4 packet that crosses between
sites from a TUN device (policy routing sends them there,
`runtime.lab.netns`), asks `runtime.lab.shaper.Shaper` when each may leave,
holds it, and writes it back, whence the kernel routes it to its site.
Python's stdlib only: the device is opened with the TUNSETIFF ioctl.

It runs at real-time priority (SCHED_FIFO; else nice -20) so a busy machine
does not delay its wake-ups, and never spins: it sleeps in `select` until
the next release. Its control pipe is stdin: the first line is the lab's
plan as JSON, then `stats` asks for its counters; end of file (the lab
closed, or died) stops it. Run as `python -m runtime.lab.delayer --tun NAME`.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import heapq
import json
import os
import random
import select
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

from runtime.lab.shaper import Shaper
from runtime.lab.topology import Plan, load_topology, make_plan

TUNSETIFF: Final = 0x400454CA
IFF_TUN: Final = 0x0001
IFF_NO_PI: Final = 0x1000
MAX_PACKET: Final = 65_535
IPV4_HEADER: Final = 20
READ_BURST: Final = 256
"""Packets read per wake-up before due ones are released, so a flood
cannot hold back what is already due."""
MAX_HELD_BYTES: Final = 64 * 1024 * 1024
"""What may wait at once: 500 ms of a gigabit link. Beyond, packets drop
(counted `overflow`), as a router's full buffer would."""
EARLY_S: Final = 50e-6
"""A packet due this soon is sent now: a shorter sleep overshoots by more."""
LATENESS_SAMPLES: Final = 20_000
"""The lateness quantiles are over the last this many releases."""
RT_PRIORITY: Final = 20
"""SCHED_FIFO priority: above every normal task, below the kernel's own
real-time threads (which default to 50 and up)."""


def raise_priority() -> str:
    """Real-time priority if the kernel allows it, else the highest nice;
    says which (measured: without it, a busy machine adds milliseconds)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
        return f"SCHED_FIFO {RT_PRIORITY}"
    except (OSError, AttributeError):
        pass
    try:
        os.nice(-20)
        return f"nice {os.nice(0)}"
    except OSError:
        return "normal (no permission to raise it)"


def open_tun(name: str) -> int:
    """An fd on TUN device `name` (created, or attached if it exists):
    each read is one IPv4/IPv6 packet, no packet-information header."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd


@dataclass
class Counters:
    """What the delayer has done, reported on `stats`."""

    forwarded: int = 0
    lost: int = 0
    unroutable: int = 0
    overflow: int = 0
    write_errors: int = 0
    held_bytes: int = 0
    lateness_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENESS_SAMPLES))

    def report(self, shaper: Shaper) -> dict[str, Any]:
        late = sorted(self.lateness_s)

        def quantile(q: float) -> float | None:
            return round(late[min(len(late) - 1, int(q * len(late)))] * 1000, 3) if late else None

        return {
            "forwarded": self.forwarded,
            "lost": self.lost,
            "unroutable": self.unroutable,
            "overflow": self.overflow,
            "write_errors": self.write_errors,
            "lateness_ms": {"p50": quantile(0.5), "p99": quantile(0.99), "max": quantile(1.0)},
            "paths": {
                f"{src}>{dst}": {"sent": c.sent, "lost": c.lost}
                for (src, dst), c in sorted(shaper.paths.items())
            },
        }


class Delayer:
    """Packets in from the TUN fd, held per the shaper, written back when due."""

    def __init__(self, tun_fd: int, plan: Plan, shaper: Shaper) -> None:
        self._fd = tun_fd
        self._shaper = shaper
        self._site_by_address = {
            bytes(int(octet) for octet in s.wan_address.split(".")): s.name for s in plan.sites
        }
        self._held: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self.counters = Counters()

    def timeout(self, now: float) -> float | None:
        """How long `select` may sleep: until the next release, or for ever."""
        return max(0.0, self._held[0][0] - now) if self._held else None

    def read(self, now: float) -> None:
        for _ in range(READ_BURST):
            try:
                packet = os.read(self._fd, MAX_PACKET)
            except BlockingIOError:
                return
            self._admit(packet, now)

    def _admit(self, packet: bytes, now: float) -> None:
        counters = self.counters
        ipv4 = len(packet) >= IPV4_HEADER and packet[0] >> 4 == 4
        src = self._site_by_address.get(packet[12:16]) if ipv4 else None
        dst = self._site_by_address.get(packet[16:20]) if src is not None else None
        if src is None or dst is None:
            counters.unroutable += 1
            return
        release = self._shaper.admit(src, dst, now)
        if release is None:
            counters.lost += 1
            return
        if counters.held_bytes + len(packet) > MAX_HELD_BYTES:
            counters.overflow += 1
            return
        self._seq += 1
        counters.held_bytes += len(packet)
        heapq.heappush(self._held, (release, self._seq, packet))

    def release_due(self, clock: Any) -> None:
        held, counters = self._held, self.counters
        while held and held[0][0] <= clock() + EARLY_S:
            release, _, packet = heapq.heappop(held)
            counters.held_bytes -= len(packet)
            try:
                os.write(self._fd, packet)
            except OSError:
                counters.write_errors += 1
                continue
            counters.forwarded += 1
            counters.lateness_s.append(max(0.0, clock() - release))

    def serve(self, control_fd: int, out: Any) -> None:
        """Run until the control pipe closes; answer `stats` lines on `out`."""
        clock = time.monotonic
        pending = b""
        while True:
            readable, _, _ = select.select([self._fd, control_fd], [], [], self.timeout(clock()))
            if self._fd in readable:
                self.read(clock())
            self.release_due(clock)
            if control_fd in readable:
                chunk = os.read(control_fd, 4096)
                if not chunk:
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip() == b"stats":
                        out.write(json.dumps(self.counters.report(self._shaper)) + "\n")
                        out.flush()


def read_line(fd: int, limit: int = 1 << 20) -> bytes:
    """One line from `fd`, read byte by byte so nothing after it is taken
    (the rest of the pipe is `serve`'s)."""
    line = bytearray()
    while len(line) < limit:
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            break
        line += byte
    return bytes(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.lab.delayer")
    parser.add_argument("--tun", required=True, help="the TUN device to read and write")
    args = parser.parse_args(argv)
    try:
        spec = json.loads(read_line(sys.stdin.fileno()))
        plan = make_plan(load_topology(spec["topology"]), spec["prefix"])
    except (ValueError, KeyError, TypeError) as exc:
        print(f"delayer: bad plan on stdin: {exc}", file=sys.stderr)
        return 2
    shaper = Shaper(plan.topology, random.Random(plan.topology.seed))
    delayer = Delayer(open_tun(args.tun), plan, shaper)
    priority = raise_priority()
    gc.disable()  # packets are bytes in tuples: no cycles, and no collector pauses
    print(json.dumps({"ready": True, "priority": priority}), flush=True)
    delayer.serve(sys.stdin.fileno(), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
