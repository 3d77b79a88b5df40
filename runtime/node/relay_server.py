"""The relay, as a trio TCP server: reservations in, spliced byte streams out.

A reachable node runs one (unless `--no-relay`). A node behind NAT connects
to its reservation port, answers the `HELLO` nonce with a signed `RESERVE`,
and gets three public ports (`RESERVED`), one per plane (control, data,
HTTP API), and the address it was seen from (its NAT's, which a direct
path needs). A dial on any of them is told to the node (`CONNECT` with a
fresh token) on the reservation; the node dials the reservation port again
with `ACCEPT token`, and the two streams are spliced byte for byte under
the relay's `TokenBucket`. The relay never parses what it forwards (ZMTP
with CURVE, end to end): it cannot read or alter it. Decisions and limits
are `mesh.relay.RelayBook`'s; every bad input is refused with a counted
reason and the server keeps running.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from mesh.identity import node_id_text, verify
from mesh.relay import (
    LINE_TIMEOUT_S,
    MAX_LINE_BYTES,
    NONCE_BYTES,
    PENDING_TIMEOUT_S,
    PLANES,
    REASON_BAD_SIGNATURE,
    REASON_GARBAGE,
    REASON_OVERSIZED,
    REASON_SLOW,
    REASON_UNKNOWN_TOKEN,
    SILENT_S,
    TOKEN_BYTES,
    LineError,
    Plane,
    RelayBook,
    TokenBucket,
    encode_line,
    parse_line,
    reserve_signing_bytes,
)

log = logging.getLogger("shardmesh.node")

CHUNK_BYTES: Final = 64 * 1024
"""One read of a spliced stream: a socket buffer's worth."""
STREAM_ERRORS: Final = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class LineReader:
    """Reads newline-ended lines of at most `MAX_LINE_BYTES` off a stream;
    what follows a line stays in `rest` (the spliced bytes may ride along)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.rest = b""

    async def line(self, timeout: float) -> bytes:
        """The next line; `LineError` (oversized, slow, garbage at EOF)."""
        with trio.move_on_after(timeout):
            while b"\n" not in self.rest:
                if len(self.rest) > MAX_LINE_BYTES:
                    raise LineError(REASON_OVERSIZED)
                data = await self.stream.receive_some(MAX_LINE_BYTES + 1)
                if not data:
                    raise LineError(REASON_GARBAGE)
                self.rest += data
            line, self.rest = self.rest.split(b"\n", 1)
            return line
        raise LineError(REASON_SLOW)


async def pump(
    src: trio.abc.ReceiveStream,
    dst: trio.abc.SendStream,
    first: bytes,
    bucket: TokenBucket | None,
    counters: Counter[str],
) -> None:
    """Copy `src` to `dst` (after `first`) until either end closes."""
    with _quiet():
        if first:
            await dst.send_all(first)
        while data := await src.receive_some(CHUNK_BYTES):
            if bucket is not None:
                wait = bucket.delay(len(data), trio.current_time())
                if wait > 0:
                    await trio.sleep(wait)
            await dst.send_all(data)
            counters["spliced_bytes"] += len(data)


async def splice(
    a: trio.SocketStream,
    a_first: bytes,
    b: trio.SocketStream,
    b_first: bytes,
    *,
    bucket: TokenBucket | None = None,
    counters: Counter[str],
) -> None:
    """Join two streams both ways (`a_first`: bytes already read from `a`,
    sent on first); when one direction ends, both close."""
    async with trio.open_nursery() as nursery:

        async def one_way(src: trio.SocketStream, dst: trio.SocketStream, first: bytes) -> None:
            await pump(src, dst, first, bucket, counters)
            nursery.cancel_scope.cancel()

        nursery.start_soon(one_way, a, b, a_first)
        nursery.start_soon(one_way, b, a, b_first)
    for stream in (a, b):
        await stream.aclose()


class _quiet:
    """Swallow a peer closing its end: ordinary for a spliced stream."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, STREAM_ERRORS)


@dataclass
class _Reservation:
    stream: trio.SocketStream
    ports: dict[Plane, int] = field(default_factory=dict)
    lock: trio.Lock = field(default_factory=trio.Lock)


@dataclass
class _Wait:
    dialer: trio.SocketStream
    taken: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)


class RelayServer:
    """A relay on `host:port` (0: any free port); `run` in a nursery."""

    def __init__(self, host: str, port: int, book: RelayBook | None = None) -> None:
        self.host, self.port = host, port
        self.book = book or RelayBook()
        self.bucket = TokenBucket()
        self.counters: Counter[str] = Counter()
        self._reservations: dict[bytes, _Reservation] = {}
        self._waits: dict[bytes, _Wait] = {}

    def status(self) -> dict[str, Any]:
        """The status document's `relays.server`."""
        return {
            "port": self.port,
            **self.book.status(),
            "forwarded_bytes": self.counters["spliced_bytes"],
        }

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen; `task_status.started(port)` once bound."""
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._on_connection, listeners)

    async def _on_connection(self, stream: trio.SocketStream) -> None:
        """A reservation (`RESERVE`) or a node dialing back (`ACCEPT`)."""
        nonce = os.urandom(NONCE_BYTES)
        reader = LineReader(stream)
        try:
            with _quiet():
                await stream.send_all(encode_line("HELLO", nonce))
                line = parse_line(await reader.line(LINE_TIMEOUT_S))
                if line.verb == "RESERVE":
                    node, signature = line.fields
                    assert isinstance(node, bytes) and isinstance(signature, bytes)
                    await self._reserve(stream, reader, nonce, node, signature)
                elif line.verb == "ACCEPT":
                    token = line.fields[0]
                    assert isinstance(token, bytes)
                    await self._accept(stream, reader.rest, token)
                else:
                    self.book.refuse(REASON_GARBAGE)
        except LineError as exc:
            self.book.refuse(exc.reason)
        finally:
            await stream.aclose()

    async def _reserve(
        self, stream: trio.SocketStream, reader: LineReader, nonce: bytes, node: bytes, sig: bytes
    ) -> None:
        if not verify(node, reserve_signing_bytes(nonce), sig):
            await stream.send_all(encode_line("REFUSED", self.book.refuse(REASON_BAD_SIGNATURE)))
            return
        refusal = self.book.reserve(node, trio.current_time())
        if refusal is not None:
            await stream.send_all(encode_line("REFUSED", refusal))
            return
        old = self._reservations.get(node)
        if old is not None:
            await old.stream.aclose()  # the node reconnected: the new one wins
        reservation = self._reservations[node] = _Reservation(stream)
        try:
            async with trio.open_nursery() as nursery:
                for plane in PLANES:
                    reservation.ports[plane] = await nursery.start(self._public_port, node, plane)
                await self._serve_reservation(reservation, reader, node)
                nursery.cancel_scope.cancel()
        finally:
            if self._reservations.get(node) is reservation:
                del self._reservations[node]
                self.book.release(node)

    async def _serve_reservation(
        self, reservation: _Reservation, reader: LineReader, node: bytes
    ) -> None:
        """Say the ports, then answer the node's pings until it goes (EOF,
        garbage or silence); every way it ends is a return."""
        ports = reservation.ports
        try:
            with _quiet():
                seen = reservation.stream.socket.getpeername()[0]
                await reservation.stream.send_all(
                    encode_line("RESERVED", *(ports[plane] for plane in PLANES), seen)
                )
                log.info("relay: ports %s for %s", ports, node_id_text(node)[:16])
                while parse_line(await reader.line(SILENT_S)).verb == "PING":
                    async with reservation.lock:
                        await reservation.stream.send_all(encode_line("PONG"))
                self.book.refuse(REASON_GARBAGE)
        except LineError as exc:
            self.book.refuse(exc.reason)

    async def _public_port(
        self, node: bytes, plane: Plane, *, task_status: trio.TaskStatus[int]
    ) -> None:
        """One plane's public port for `node`'s reservation, while it lasts."""
        listeners = await trio.open_tcp_listeners(0, host=self.host)
        task_status.started(listeners[0].socket.getsockname()[1])

        async def dialed(stream: trio.SocketStream) -> None:
            await self._dialed(stream, node, plane)

        await trio.serve_listeners(dialed, listeners)

    async def _dialed(self, dialer: trio.SocketStream, node: bytes, plane: Plane) -> None:
        """Someone dialed `node`'s `plane`: ask the node to dial back, splice."""
        token = os.urandom(TOKEN_BYTES)
        reservation = self._reservations.get(node)
        if reservation is None or self.book.dialed(node, plane, token, trio.current_time()):
            await dialer.aclose()
            return
        wait = self._waits[token] = _Wait(dialer)
        try:
            with _quiet():
                async with reservation.lock:
                    await reservation.stream.send_all(encode_line("CONNECT", token, plane))
            with trio.move_on_after(PENDING_TIMEOUT_S):
                await wait.taken.wait()
            if not wait.taken.is_set():
                self.book.abandon(token)
                await dialer.aclose()
                return
            await wait.done.wait()
        finally:
            self._waits.pop(token, None)

    async def _accept(self, stream: trio.SocketStream, first: bytes, token: bytes) -> None:
        wait = self._waits.get(token)
        if wait is None or wait.taken.is_set():
            self.book.refuse(REASON_UNKNOWN_TOKEN)
            return
        if self.book.accepted(token, trio.current_time()) is None:
            return
        wait.taken.set()
        try:
            await splice(
                wait.dialer, b"", stream, first, bucket=self.bucket, counters=self.counters
            )
        finally:
            self.book.ended()
            wait.done.set()
