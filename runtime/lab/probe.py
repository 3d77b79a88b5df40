"""The lab's measuring instruments: small UDP programs run inside its sites.

`echo` answers every datagram with the datagram and the address it came
from as this end saw it (so a peer learns its NAT's external port); with
`--punch` it first sends one datagram to each address given, opening its
NAT for replies from there. `ping` sends numbered probes from one socket
to one or more echoes and prints each one's round-trip times, losses and
the address it was seen as. `blast` sends at a fixed rate; `sink` counts
what arrives and prints its rate (of IPv4 packets, bytes/s). Each prints
one JSON line and runs for a bounded time; `runtime.lab.netns.Lab` starts
them with `ip netns exec`.
Run as `python -m runtime.lab.probe {echo,ping,blast,sink} ...`.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from runtime.lab.delayer import raise_priority

MAX_DATAGRAM: Final = 65_507
IP_UDP_HEADERS: Final = 28
"""What a datagram's IPv4 packet adds to its payload: the sink's rate is of packets."""
MAX_LIFETIME_S: Final = 3600.0
"""No instrument outlives an hour, whoever forgot to stop it."""


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    return sock


def _say(document: dict[str, Any]) -> None:
    print(json.dumps(document), flush=True)


def echo(port: int, punch: Sequence[tuple[str, int]], lifetime_s: float) -> None:
    """Answer datagrams on `port` until `lifetime_s` has passed."""
    sock = _socket(port)
    for target in punch:
        sock.sendto(b"punch", target)
    _say({"ready": True, "port": sock.getsockname()[1]})
    deadline = time.monotonic() + lifetime_s
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            continue
        data, (host, source_port) = sock.recvfrom(MAX_DATAGRAM)
        if data.startswith(b"probe "):
            sock.sendto(data + f" {host}:{source_port}".encode(), (host, source_port))


@dataclass
class Target:
    """One echo's answers to `ping`."""

    sent: int = 0
    rtt_ms: list[float] = field(default_factory=list)
    seen_as: str | None = None


def ping(
    targets: Sequence[tuple[str, int]], port: int, count: int, interval_s: float, wait_s: float
) -> dict[str, Any]:
    """`count` probes to each target, one round every `interval_s`, from one
    socket on `port` (0: any); replies wait up to `wait_s` after the last
    round (no longer once every probe is answered)."""
    sock = _socket(port)
    names = [f"{host}:{p}" for host, p in targets]
    results = {name: Target() for name in names}
    sent_at: dict[bytes, float] = {}
    start = time.monotonic()
    rounds = 0
    deadline = start + count * interval_s + wait_s
    while (now := time.monotonic()) < deadline and (rounds < count or sent_at):
        if rounds < count and now >= start + rounds * interval_s:
            for name, target in zip(names, targets, strict=True):
                key = f"{rounds} {name}".encode()
                sent_at[key] = time.monotonic()
                results[name].sent += 1
                try:
                    sock.sendto(b"probe " + key, target)
                except OSError:  # no route (yet): a probe lost like any other
                    del sent_at[key]
            rounds += 1
            continue
        due = start + rounds * interval_s if rounds < count else deadline
        if select.select([sock], [], [], max(0.0, due - now))[0]:
            _answer(sock, sent_at, results)
    return {
        "local_port": sock.getsockname()[1],
        "targets": {n: vars(r) for n, r in results.items()},
    }


def _answer(sock: socket.socket, sent_at: dict[bytes, float], results: dict[str, Target]) -> None:
    data = sock.recv(MAX_DATAGRAM)
    now = time.monotonic()
    parts = data.split(b" ")
    if len(parts) != 4 or parts[0] != b"probe":
        return
    key = parts[1] + b" " + parts[2]
    sent = sent_at.pop(key, None)  # a duplicate counts once
    target = results.get(parts[2].decode(errors="replace"))
    if sent is None or target is None:
        return
    target.rtt_ms.append(round((now - sent) * 1000, 3))
    target.seen_as = parts[3].decode(errors="replace")


def blast(target: tuple[str, int], rate: int, size: int, duration_s: float) -> dict[str, Any]:
    """Send `size`-byte datagrams at `rate` bytes/s for `duration_s`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    payload = b"x" * size
    start = time.monotonic()
    sent = 0
    while (elapsed := time.monotonic() - start) < duration_s:
        if sent * size < rate * elapsed:
            try:
                sock.sendto(payload, target)
                sent += 1
            except OSError:  # a full local queue: the link is slower than the rate
                time.sleep(0.001)
        else:
            time.sleep(min(0.002, size / rate))
    return {"sent_packets": sent, "sent_bytes": sent * size, "duration_s": duration_s}


def sink(port: int, idle_s: float, lifetime_s: float) -> dict[str, Any]:
    """Count datagrams on `port` until none came for `idle_s` after the first."""
    sock = _socket(port)
    _say({"ready": True, "port": sock.getsockname()[1]})
    deadline = time.monotonic() + lifetime_s
    first = last = 0.0
    packets = size = 0
    while (now := time.monotonic()) < deadline:
        if packets and now - last > idle_s:
            break
        if select.select([sock], [], [], min(idle_s, deadline - now))[0]:
            data = sock.recv(MAX_DATAGRAM)
            last = time.monotonic()
            first = first or last
            packets += 1
            size += len(data) + IP_UDP_HEADERS
    span = last - first
    # the first packet only starts the clock: the rate is of those after it
    rate = (size - size / packets) / span if packets > 1 and span > 0 else None
    return {"packets": packets, "ip_bytes": size, "span_s": round(span, 4), "rate": rate}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime.lab.probe")
    tools = parser.add_subparsers(dest="tool", required=True)
    lifetime = {"type": float, "default": 60.0, "help": "seconds before it stops by itself"}
    e = tools.add_parser("echo", help="answer UDP probes")
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--punch", type=_endpoint, action="append", default=[], metavar="HOST:PORT")
    e.add_argument("--lifetime", **lifetime)  # type: ignore[arg-type]
    p = tools.add_parser("ping", help="probe echoes, print round-trip times")
    p.add_argument("--to", type=_endpoint, action="append", required=True, metavar="HOST:PORT")
    p.add_argument("--port", type=int, default=0, help="local port (default: any)")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.02, help="seconds between rounds")
    p.add_argument("--wait", type=float, default=1.0, help="seconds for the last replies")
    b = tools.add_parser("blast", help="send UDP at a fixed rate")
    b.add_argument("--to", type=_endpoint, required=True, metavar="HOST:PORT")
    b.add_argument("--rate", type=int, required=True, help="bytes per second")
    b.add_argument("--size", type=int, default=1200, help="bytes per datagram")
    b.add_argument("--duration", type=float, default=1.0)
    s = tools.add_parser("sink", help="count UDP arriving, print the rate")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--idle", type=float, default=0.5, help="seconds of silence that end it")
    s.add_argument("--lifetime", **lifetime)  # type: ignore[arg-type]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tool in ("echo", "ping"):  # their own wake-ups are not the network's latency
        raise_priority()  # (never blast's: at real-time priority it would hog a core)
    lifetime = min(getattr(args, "lifetime", MAX_LIFETIME_S), MAX_LIFETIME_S)
    if args.tool == "echo":
        echo(args.port, args.punch, lifetime)
    elif args.tool == "ping":
        _say(ping(args.to, args.port, args.count, args.interval, args.wait))
    elif args.tool == "blast":
        _say(blast(args.to, args.rate, args.size, min(args.duration, MAX_LIFETIME_S)))
    else:
        _say(sink(args.port, args.idle, lifetime))
    return 0


if __name__ == "__main__":
    sys.exit(main())
