"""A node behind NAT holding a relay reservation, as a trio task.

`hold_reservation` connects out to a relay's reservation port, signs the
relay's nonce with the node's key (`RESERVE`), hears the public ports it
got (`RESERVED`: control plane, data plane, HTTP API), and then keeps the
reservation alive with pings. Each `CONNECT` the relay sends means someone
dialed one of those ports: the node dials the relay again (outbound: its
NAT lets that through), says `ACCEPT token`, connects to its own plane on
this machine (the address the plane is bound to) and splices the two, so
libzmq sees an ordinary inbound TCP connection and runs CURVE with the
remote peer end to end. Which relays to hold is `mesh.relay.RelaySet`'s
choice (`runtime/node/relays.py`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Final

import trio

from mesh.identity import Signer
from mesh.relay import (
    KEEPALIVE_S,
    LINE_TIMEOUT_S,
    PLANES,
    SILENT_S,
    LineError,
    Plane,
    encode_line,
    parse_line,
    reserve_signing_bytes,
)
from runtime.node.hostport import HostPort, parse_hostport
from runtime.node.relay_server import STREAM_ERRORS, LineReader, splice

log = logging.getLogger("shardmesh.node")

CONNECT_TIMEOUT_S: Final = 5.0
"""A TCP connect to a relay: a SYN to a reachable host answers in one RTT;
one that does not answer in five seconds is no relay to use."""


class RelayRefused(Exception):
    """The relay said no (`REFUSED reason`) or broke the protocol."""


async def _connect(at: HostPort) -> tuple[trio.SocketStream, LineReader, bytes]:
    """A connection to the relay, past its `HELLO`: (stream, reader, nonce)."""
    with trio.fail_after(CONNECT_TIMEOUT_S):
        stream = await trio.open_tcp_stream(at.host, at.port)
    reader = LineReader(stream)
    try:
        hello = parse_line(await reader.line(LINE_TIMEOUT_S))
    except LineError as exc:
        await stream.aclose()
        raise RelayRefused(f"no HELLO ({exc.reason})") from None
    if hello.verb != "HELLO":
        await stream.aclose()
        raise RelayRefused(f"said {hello.verb}, not HELLO")
    nonce = hello.fields[0]
    assert isinstance(nonce, bytes)
    return stream, reader, nonce


async def hold_reservation(
    signer: Signer,
    relay: str,
    local: Mapping[Plane, HostPort],
    on_reserved: Callable[[dict[Plane, HostPort], str], None],
    counters: Counter[str],
) -> None:
    """Reserve at `relay` (`tcp://H:P`) and serve its dials to the planes
    bound at `local` until the reservation ends; `on_reserved(ports, seen)`
    hears where each plane is reached at the relay, and the address the
    relay saw this node come from (its NAT's public one). Returns or raises (`RelayRefused`,
    a stream error, `trio.TooSlowError`) when the reservation is over."""
    at = parse_hostport(relay)
    stream, reader, nonce = await _connect(at)
    async with stream:
        signature = signer.sign(reserve_signing_bytes(nonce))
        await stream.send_all(encode_line("RESERVE", signer.node_id, signature))
        try:
            answer = parse_line(await reader.line(LINE_TIMEOUT_S))
        except LineError as exc:
            raise RelayRefused(exc.reason) from None
        if answer.verb != "RESERVED":
            raise RelayRefused(" ".join(str(f) for f in answer.fields) or answer.verb)
        *ports, seen = answer.fields
        assert isinstance(seen, str)
        relayed = {
            plane: HostPort(at.host, int(port)) for plane, port in zip(PLANES, ports, strict=True)
        }
        on_reserved(relayed, seen)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ping, stream)
            await _serve(reader, at, local, nursery, counters)
            nursery.cancel_scope.cancel()


async def _ping(stream: trio.SocketStream) -> None:
    while True:
        try:
            await stream.send_all(encode_line("PING"))
        except STREAM_ERRORS:
            return
        await trio.sleep(KEEPALIVE_S)


async def _serve(
    reader: LineReader,
    at: HostPort,
    local: Mapping[Plane, HostPort],
    nursery: trio.Nursery,
    counters: Counter[str],
) -> None:
    """Each `CONNECT` dials back; returns when the relay goes quiet or away."""
    while True:
        try:
            line = parse_line(await reader.line(SILENT_S))
        except (LineError, *STREAM_ERRORS):
            return
        if line.verb == "CONNECT":
            token, plane = line.fields
            assert isinstance(token, bytes) and isinstance(plane, str)
            if plane not in local:
                counters["relay_plane_not_offered"] += 1  # the relay times the dial out
                continue
            nursery.start_soon(_accept, at, token, local[plane], counters)  # type: ignore[index]
        elif line.verb != "PONG":
            counters["relay_garbage"] += 1
            return


async def _accept(at: HostPort, token: bytes, plane: HostPort, counters: Counter[str]) -> None:
    """Dial the relay back for `token` and splice it to our own plane."""
    try:
        stream, reader, _ = await _connect(at)
    except (RelayRefused, trio.TooSlowError, *STREAM_ERRORS):
        counters["relay_dial_back_failed"] += 1
        return
    try:
        await stream.send_all(encode_line("ACCEPT", token))
        with trio.fail_after(CONNECT_TIMEOUT_S):
            own = await trio.open_tcp_stream(plane.host, plane.port)
    except (trio.TooSlowError, *STREAM_ERRORS):
        counters["relay_local_connect_failed"] += 1
        await stream.aclose()
        return
    counters["relay_sessions"] += 1
    await splice(stream, reader.rest, own, b"", counters=counters)
