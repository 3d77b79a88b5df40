"""The ZeroMQ transport, over real sockets on 127.0.0.1 (no mocks).

Every wait is bounded by trio.fail_after so a regression fails fast instead
of hanging the suite.
"""

from __future__ import annotations

import collections
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AsyncExitStack,
    asynccontextmanager,
    contextmanager,
    suppress,
)
from dataclasses import replace

import pytest
import trio
import zmq
from zmq.utils.monitor import recv_monitor_message

from mesh.chunks import FRAME_LIMIT_BYTES, PIECE_BYTES
from mesh.identity import Identity, PlaneKeys, curve_twin
from mesh.newcomers import R_ADDRESS, R_PREFIX, NewcomerLimit
from mesh.transport import (
    CONTROL_MAX_MESSAGE_BYTES,
    DATA_MAX_MESSAGE_BYTES,
    DEFAULT_DATA_CONFIG,
    NODE_ID_PROPERTY,
    TCP_RTO_MIN_US,
    Plane,
    PlaneConfig,
    open_plane,
    open_planes,
    tune_rto_min,
)
from mesh.zap import HandshakeGate

LOCAL = "tcp://127.0.0.1:0"
# A node nobody runs: what a send to an address with no node behind it names.
STRANGER = Identity.generate().node_id
# Generous for loopback, where everything here takes milliseconds.
WAIT_S = 5.0


def new_keys() -> PlaneKeys:
    return Identity.generate().plane_keys()


def total_drops(drops: collections.Counter[str], prefix: str = "") -> int:
    return sum(n for key, n in drops.items() if key.startswith(prefix))


@asynccontextmanager
async def planes(
    n: int,
    drops: collections.Counter[str],
    *,
    max_message_bytes: int = CONTROL_MAX_MESSAGE_BYTES,
    config: PlaneConfig | None = None,
    name: str = "control",
    chunked: bool = False,
) -> AsyncIterator[list[Plane]]:
    """``n`` planes (control ones unless told) on loopback ports, all
    counting into ``drops``."""
    async with AsyncExitStack() as stack:
        opened = [
            await stack.enter_async_context(
                open_plane(
                    LOCAL,
                    name=name,
                    max_message_bytes=max_message_bytes,
                    drops=drops,
                    keys=new_keys(),
                    config=config,
                    chunked=chunked,
                )
            )
            for _ in range(n)
        ]
        yield opened


RAW_SEND_TIMEOUT_MS = int(WAIT_S * 1000)
"""A raw socket's send gives up (zmq.Again) rather than blocking the test:
a DEALER whose only connection was refused has no pipe to queue into."""


def try_send(sock: zmq.Socket, data: bytes) -> None:
    """A send whose delivery the test does not need (the handshake, made at
    connect, is what it checks): once a refused handshake has dropped the
    socket's only pipe, there is nowhere to queue it, which is fine."""
    with suppress(zmq.Again):
        sock.send(data, flags=zmq.NOBLOCK)


@contextmanager
def raw_socket(
    kind: int,
    server: Plane,
    routing_id: bytes | None = None,
    *,
    encrypted: bool = True,
    claim: bytes | None = None,
    keys: PlaneKeys | None = None,
    source: str | None = None,
) -> Iterator[zmq.Socket]:
    """A plain pyzmq socket connected to ``server``, for sending junk: a
    CURVE client with a key of its own (or ``keys``) that names itself (or
    ``claim``) in its handshake, or (``encrypted=False``) a plaintext one;
    from the loopback address ``source`` if given (any of 127.0.0.0/8)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, RAW_SEND_TIMEOUT_MS)
    if routing_id is not None:
        sock.setsockopt(zmq.CONNECT_ROUTING_ID, routing_id)
    if encrypted:
        keys = keys or new_keys()
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.curve_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.curve_secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server.keys.curve_public)
        named = (claim or keys.node_id).hex()
        sock.setsockopt(zmq.METADATA, f"{NODE_ID_PROPERTY}:{named}".encode())
    if source is None:
        sock.connect(server.address)
    else:
        sock.connect(f"tcp://{source}:0;{server.address.removeprefix('tcp://')}")
    try:
        yield sock
    finally:
        sock.close(linger=0)


def dead_address() -> str:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


async def test_a_message_to_itself_never_touches_the_sockets() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(1, drops) as (a,):
        body = bytearray(b"world")
        a.send(a.address, [b"hello", memoryview(body)], peer=a.keys.node_id)
        body[:] = b"WORLD"  # the receiver got its own copy
        advertised = "tcp://192.0.2.7:7001"  # a name only this plane knows itself by
        a.add_own_address(advertised)
        a.send(advertised, [b"advertised"], peer=a.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await a.receive()).frames == [b"hello", b"world"]
            assert (await a.receive()).frames == [b"advertised"]
        assert a.peer_count == 0  # no connection was made
        assert a.sent_messages == a.received_messages == 2
    assert not drops


async def test_a_handler_takes_messages_from_the_reader_until_it_is_cleared() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        a.send(b.address, [b"queued before"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            while b.received_messages < 1:
                await trio.sleep(0.01)
        handled: list[list[bytes]] = []
        b.deliver_to(
            lambda peer, frames: handled.append(frames) if peer == a.keys.node_id else None
        )
        a.send(b.address, [b"to the handler", b"2"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            while not handled:
                await trio.sleep(0.01)
            assert handled == [[b"to the handler", b"2"]]
            assert (await b.receive()).frames == [b"queued before"]  # stays queued
        b.deliver_to(None)
        a.send(b.address, [b"queued again"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"queued again"]
        assert len(handled) == 1
    assert not drops


async def test_a_plane_knows_where_each_peers_messages_come_from() -> None:
    """The source address is the connection's (libzmq's Peer-Address), so a
    peer connecting from another loopback address is seen there; the plane
    itself and peers never heard from have none."""
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        a.send(b.address.replace("tcp://", "tcp://127.0.5.9:0;"), [b"hi"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            delivery = await b.receive()
        assert delivery.peer == a.keys.node_id
        assert b.source_of(a.keys.node_id) == "127.0.5.9"
        assert b.source_of(b.keys.node_id) is None and b.source_of(STRANGER) is None
    assert not drops


def kernel_takes_rto_min() -> bool:
    with socket.socket() as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, 10_000)
        except OSError:
            return False
    return True


async def test_a_planes_connections_retransmit_after_its_floor_not_the_systems() -> None:
    """Where the kernel has TCP_RTO_MIN_US, every connection the plane makes
    gets its `rto_min_ms` (a lost decode step then waits tens of
    milliseconds, not 200); elsewhere the plane says it could not."""
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        a.send(b.address, [b"hi"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            await b.receive()
            while not a.rto_tuned:
                await trio.sleep(0.01)
    supported = kernel_takes_rto_min()
    assert a.rto_tuned == {supported: 1}
    with socket.socket() as sock:
        assert tune_rto_min(sock.fileno(), 20.0) == supported
        if supported:  # rounded up to the kernel's clock tick
            assert 20_000 <= sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US) < 40_000
    read, write = os.pipe()
    assert not tune_rto_min(read, 20.0), "a closed connection's number reused by a pipe"
    os.close(read)
    os.close(write)


async def test_two_planes_exchange_multiframe_messages_both_ways() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        assert a.address != b.address
        assert a.address.startswith("tcp://127.0.0.1:") and not a.address.endswith(":0")
        body = os.urandom(10_000)
        a.send(b.address, [b"header", memoryview(body), b""], peer=b.keys.node_id)
        b.send(a.address, [b"reply", b"second", b"third"], peer=a.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"header", body, b""]
            assert (await a.receive()).frames == [b"reply", b"second", b"third"]
        assert a.sent_messages == 1 and a.sent_bytes == len(b"header") + len(body)
        assert b.received_messages == 1 and b.received_bytes == a.sent_bytes
        assert a.received_messages == 1 and b.sent_messages == 1
    assert not drops


async def test_send_right_after_first_connect_is_delivered() -> None:
    """With IMMEDIATE=0 the pipe exists from connect(), so the very first
    message waits in it for the handshake instead of being refused."""
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        assert a.peer_count == 0
        a.send(b.address, [b"first"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"first"]
        assert a.peer_count == 1
    assert not drops


async def test_burst_of_1000_all_arrive_or_are_counted() -> None:
    drops: collections.Counter[str] = collections.Counter()
    count = 1000
    async with planes(2, drops) as (a, b):
        for i in range(count):
            a.send(b.address, [b"burst", i.to_bytes(4, "big")], peer=b.keys.node_id)
        seen: list[int] = []
        with trio.fail_after(WAIT_S):
            while len(seen) + total_drops(drops) < count:
                with trio.move_on_after(0.05):
                    frames = (await b.receive()).frames
                    assert frames[0] == b"burst"
                    seen.append(int.from_bytes(frames[1], "big"))
        assert len(seen) + total_drops(drops) == count
        assert seen == sorted(seen), "one pipe delivers in order"
        assert set(drops) <= {"control.peer_queue_full", "control.send_queue_full"}


async def test_unreachable_address_never_raises_and_is_counted() -> None:
    drops: collections.Counter[str] = collections.Counter()
    hwm = 10
    attempts = 50
    config = PlaneConfig(hwm=hwm, unreachable_after_s=0.3)
    async with planes(2, drops, config=config) as (a, b):
        nowhere = dead_address()
        for i in range(attempts):
            a.send(nowhere, [b"into the void", bytes([i])], peer=STRANGER)
        with trio.fail_after(WAIT_S):
            while total_drops(drops) < attempts:
                await trio.sleep(0.02)
        # hwm messages waited in the pipe and were dropped when we gave up on
        # the peer; the rest never fit in it.
        assert drops["control.unreachable"] == hwm
        assert drops["control.peer_queue_full"] == attempts - hwm
        assert a.peer_count == 0, "an unreachable peer is disconnected and forgotten"
        a.send(b.address, [b"still alive"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"still alive"]


async def test_bad_addresses_are_counted_not_raised() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        a.send("nonsense", [b"x"], peer=STRANGER)
        a.send("tcp://127.0.0.1", [b"x"], peer=STRANGER)  # no port
        a.send("tcp://" + "h" * 300 + ":1", [b"x"], peer=STRANGER)  # too long for a routing id
        a.send(b.address, [b"fine"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"fine"]
        assert drops["control.bad_address"] == 3
        with pytest.raises(ValueError):
            a.send(b.address, [], peer=b.keys.node_id)
        with pytest.raises(TypeError):
            a.send(b.address, ["text is not bytes"], peer=b.keys.node_id)  # type: ignore[list-item]


async def test_oversized_messages_are_refused_and_the_plane_keeps_serving() -> None:
    drops: collections.Counter[str] = collections.Counter()
    cap = 1024
    async with planes(2, drops, max_message_bytes=cap) as (a, b):
        # Our own sender refuses at once rather than make the peer drop the
        # whole connection.
        a.send(b.address, [b"x" * (cap + 1)], peer=b.keys.node_id)
        assert drops["control.oversized"] == 1

        with (
            raw_socket(zmq.DEALER, b) as big,
            raw_socket(zmq.DEALER, b) as split,
        ):
            # One frame over MAXMSGSIZE: libzmq drops that connection.
            big.send(b"y" * (cap * 4), zmq.NOBLOCK)
            # Frames each under the cap but together over it: the plane drops
            # the message and counts it; the connection stays.
            split.send_multipart([b"a" * 600, b"b" * 600, b"c"], zmq.NOBLOCK)
            split.send_multipart([b"marker"], zmq.NOBLOCK)
            with trio.fail_after(WAIT_S):
                assert (await b.receive()).frames == [b"marker"]
            assert drops["control.oversized"] == 2

            # Another sender still gets through.
            a.send(b.address, [b"normal"], peer=b.keys.node_id)
            with trio.fail_after(WAIT_S):
                assert (await b.receive()).frames == [b"normal"]
            # And the refused sender, once reconnected, is served again.
            big.send(b"small now", zmq.NOBLOCK)
            with trio.fail_after(WAIT_S):
                assert (await b.receive()).frames == [b"small now"]


async def test_garbage_from_raw_sockets_does_not_break_the_plane() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        junk = [os.urandom(n) for n in (0, 1, 17, 300)]
        with (
            raw_socket(zmq.ROUTER, b, routing_id=b"peer") as router,
            raw_socket(zmq.DEALER, b) as dealer,
        ):
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            with trio.fail_after(WAIT_S):
                while True:  # a ROUTER may send only once its pipe is up
                    try:
                        router.send_multipart([b"peer", *junk], zmq.NOBLOCK)
                        break
                    except zmq.ZMQError:
                        await trio.sleep(0.01)
                dealer.send_multipart([b""] * 5, zmq.NOBLOCK)
                # Not ZMTP/3 at all. libzmq either fails the handshake or, if
                # the first byte happens not to be 0xFF, parses it as legacy
                # ZMTP/1.0 frames and may deliver junk: both are fine.
                host, port = b.address.removeprefix("tcp://").rsplit(":", 1)
                stream = await trio.open_tcp_stream(host, int(port))
                async with stream:
                    with trio.move_on_after(0.2):  # libzmq may hang up first
                        await stream.send_all(os.urandom(4096))
                a.send(b.address, [b"after the junk"], peer=b.keys.node_id)
                received: list[list[bytes]] = []
                wanted = (junk, [b""] * 5, [b"after the junk"])
                while not all(message in received for message in wanted):
                    received.append((await b.receive()).frames)
        # The plane passes frames through untouched (validation is the wire
        # layer's job) and keeps serving its real peers.
        a.send(b.address, [b"still serving"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            while (await b.receive()).frames != [b"still serving"]:
                pass


async def test_peer_table_is_bounded_and_reconnects_after_eviction() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with (
        planes(1, drops, config=PlaneConfig(max_peers=2)) as (a,),
        planes(3, drops) as targets,
    ):
        with trio.fail_after(WAIT_S):
            for target in targets:
                a.send(target.address, [b"hello"], peer=target.keys.node_id)
                assert (await target.receive()).frames == [b"hello"]
                assert a.peer_count <= 2
            # The first target was evicted; sending again reconnects with a
            # fresh routing id (reusing the old one would abort libzmq).
            a.send(targets[0].address, [b"again"], peer=targets[0].keys.node_id)
            assert (await targets[0].receive()).frames == [b"again"]
        assert a.peer_count == 2
    assert not drops


async def test_open_planes_gives_separate_control_and_data_planes() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with (
        open_planes(LOCAL, LOCAL, drops=drops, keys=new_keys()) as (control, data),
        open_planes(LOCAL, LOCAL, drops=drops, keys=new_keys()) as (control2, data2),
    ):
        assert (control.name, data.name) == ("control", "data")
        assert control.max_message_bytes == CONTROL_MAX_MESSAGE_BYTES
        assert data.max_message_bytes == DATA_MAX_MESSAGE_BYTES
        activation = os.urandom(8 * 1024 * 1024)  # over the control cap
        # Bigger than one chunk: data2 takes it only from a peer it allows.
        data2.allow_bulk(lambda peer: DATA_MAX_MESSAGE_BYTES if peer == data.keys.node_id else 0)
        control.send(control2.address, [activation], peer=control2.keys.node_id)
        data.send(data2.address, [b"header", activation], peer=data2.keys.node_id)
        control.send(control2.address, [b"probe"], peer=control2.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await control2.receive()).frames == [b"probe"]
            assert (await data2.receive()).frames == [b"header", activation]
        assert drops == collections.Counter({"control.oversized": 1})


def data_planes(
    n: int, drops: collections.Counter[str], *, config: PlaneConfig = DEFAULT_DATA_CONFIG
) -> AbstractAsyncContextManager[list[Plane]]:
    """``n`` chunked (data) planes on loopback ports, all counting into ``drops``."""
    return planes(
        n,
        drops,
        max_message_bytes=DATA_MAX_MESSAGE_BYTES,
        config=config,
        name="data",
        chunked=True,
    )


def allowing(*senders: Plane) -> Callable[[bytes], int]:
    """An allowance for big messages from ``senders`` only."""
    allowed = {sender.keys.node_id for sender in senders}
    return lambda peer: DATA_MAX_MESSAGE_BYTES if peer in allowed else 0


async def test_a_big_message_from_an_allowed_peer_arrives_whole_in_chunks() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with data_planes(2, drops) as (a, b):
        b.allow_bulk(allowing(a))
        prefill = [b"header", os.urandom(5 * PIECE_BYTES + 123)]
        a.send(b.address, prefill, peer=b.keys.node_id)
        a.send(b.address, [b"after"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            got = await b.receive()
            assert got.peer == a.keys.node_id and got.frames == prefill
            assert (await b.receive()).frames == [b"after"]
        assert a.sent_messages == b.received_messages == 2
        assert b.received_bytes == a.sent_bytes == sum(map(len, prefill)) + len(b"after")
    assert not drops


async def test_a_big_message_from_a_peer_not_allowed_is_dropped_and_counted() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with data_planes(3, drops) as (a, b, stranger):
        b.allow_bulk(allowing(a))
        big = [b"header", os.urandom(3 * PIECE_BYTES)]
        stranger.send(b.address, big, peer=b.keys.node_id)
        stranger.send(b.address, [b"small is fine"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"small is fine"]
        # Every chunk refused: the header's piece and three of the payload.
        assert drops == collections.Counter({"data.bulk_refused": 4})
        # Unchunked frames each within one chunk but together bigger are
        # refused too; the connection stays.
        with raw_socket(zmq.DEALER, b) as raw:
            raw.send_multipart([bytes(PIECE_BYTES)] * 2, zmq.NOBLOCK)
            raw.send(b"marker", zmq.NOBLOCK)
            with trio.fail_after(WAIT_S):
                assert (await b.receive()).frames == [b"marker"]
        assert drops["data.oversized"] == 1
        a.send(b.address, big, peer=b.keys.node_id)  # the allowed peer is served
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == big
        b.allow_bulk(None)  # and refused once nobody is allowed
        a.send(b.address, big, peer=b.keys.node_id)
        a.send(b.address, [b"done"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"done"]
        assert drops["data.bulk_refused"] == 8


async def test_a_frame_over_one_chunk_drops_its_connection() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with data_planes(2, drops) as (a, b):
        b.allow_bulk(allowing(a))  # even an allowed peer's frames are one chunk at most
        with raw_socket(zmq.DEALER, b, keys=a.keys) as raw:
            monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                raw.send(bytes(FRAME_LIMIT_BYTES + 1), zmq.NOBLOCK)
                with trio.fail_after(WAIT_S):
                    while True:
                        try:
                            if recv_monitor_message(monitor, zmq.NOBLOCK)["event"]:
                                break
                        except zmq.Again:
                            await trio.sleep(0.01)
            finally:
                raw.disable_monitor()
                monitor.close(linger=0)
        assert b.received_messages == 0
        a.send(b.address, [b"others are served"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"others are served"]
    assert not drops


async def test_a_message_of_many_frames_is_cut_before_the_plane_holds_it_whole() -> None:
    """libzmq keeps a message's frames until its last; 40 frames of 1 MiB,
    each under the frame limit, make the guard cut the connection at about
    6 MiB held. The message never arrives; others are served."""
    drops: collections.Counter[str] = collections.Counter()
    async with data_planes(2, drops) as (a, b):
        b.allow_bulk(allowing(a))  # even an allowed peer may not hold that much
        with raw_socket(zmq.DEALER, b, keys=a.keys) as raw:
            raw.send_multipart([bytes(PIECE_BYTES)] * 40, zmq.NOBLOCK)
            with trio.fail_after(WAIT_S):
                while not drops["data.held_cut"]:
                    await trio.sleep(0.01)
        assert b.received_messages == 0 and len(b.held.ledger) < 2
        a.send(b.address, [b"others are served"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"others are served"]
    assert drops == collections.Counter({"data.held_cut": 1})


async def test_a_big_message_to_a_plane_that_stalls_is_not_cut() -> None:
    """Complete chunks that wait while the plane's thread is busy are held
    too, but no more than the receive high-water mark lets in."""
    drops: collections.Counter[str] = collections.Counter()
    async with data_planes(2, drops) as (a, b):
        b.allow_bulk(allowing(a))
        prefill = [b"header", os.urandom(20 * PIECE_BYTES)]
        a.send(b.address, prefill, peer=b.keys.node_id)
        for _ in range(3):
            time.sleep(0.2)  # the whole trio thread, guard and reader alike
            await trio.sleep(0.01)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == prefill
    assert not drops


async def test_bytes_over_a_peers_budget_are_dropped_unless_it_is_allowed() -> None:
    drops: collections.Counter[str] = collections.Counter()
    config = replace(DEFAULT_DATA_CONFIG, peer_rate_bytes_per_s=1.0, peer_burst_bytes=100_000)
    async with data_planes(3, drops, config=config) as (a, b, allowed):
        b.allow_bulk(allowing(allowed))
        for _ in range(3):
            a.send(b.address, [bytes(60_000)], peer=b.keys.node_id)
        a.send(b.address, [b"tiny"], peer=b.keys.node_id)  # within the 40,000 left
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [bytes(60_000)]
            assert (await b.receive()).frames == [b"tiny"]
        assert drops == collections.Counter({"data.over_budget": 2})
        # A peer the owner allows big messages is not held back by its budget.
        for size in (60_000, 60_000, 3 * PIECE_BYTES):
            allowed.send(b.address, [bytes(size)], peer=b.keys.node_id)
            with trio.fail_after(WAIT_S):
                assert (await b.receive()).frames == [bytes(size)]
        assert drops == collections.Counter({"data.over_budget": 2})


async def test_closing_a_plane_ends_its_tasks_and_frees_the_port() -> None:
    drops: collections.Counter[str] = collections.Counter()
    outcome: list[str] = []

    async def reader(plane: Plane) -> None:
        try:
            await plane.receive()
        except trio.EndOfChannel:
            outcome.append("end of channel")

    with trio.fail_after(WAIT_S):
        # The plane closes first (inner context), then the nursery waits for
        # the reader, which must wake with EndOfChannel instead of hanging.
        async with (
            trio.open_nursery() as nursery,
            open_plane(
                LOCAL, name="control", max_message_bytes=1024, drops=drops, keys=new_keys()
            ) as plane,
        ):
            nursery.start_soon(reader, plane)
            plane.send(dead_address(), [b"queued, then discarded on close"], peer=STRANGER)
            await trio.sleep(0.05)
        assert outcome == ["end of channel"]
        assert plane.closed
        plane.send(plane.address, [b"late"], peer=plane.keys.node_id)  # never raises
        assert drops["control.closed"] == 1
        # The listen port is released: the same endpoint binds again. libzmq
        # closes the listener on its I/O thread just after close() returns,
        # so allow it a moment.
        while True:
            try:
                async with open_plane(
                    plane.address,
                    name="control",
                    max_message_bytes=1024,
                    drops=drops,
                    keys=new_keys(),
                ) as again:
                    assert again.address == plane.address
                    break
            except zmq.ZMQError as exc:
                assert exc.errno == zmq.EADDRINUSE
                await trio.sleep(0.01)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        PlaneConfig(hwm=0)
    with pytest.raises(ValueError):
        PlaneConfig(receive_hwm=0)
    with pytest.raises(ValueError):
        PlaneConfig(peer_rate_bytes_per_s=0)
    with pytest.raises(ValueError):
        PlaneConfig(heartbeat_ttl_ms=10_000_000)
    with pytest.raises(ValueError):
        PlaneConfig(reconnect_ivl_ms=500, reconnect_ivl_max_ms=100)


async def test_only_a_peer_that_proves_its_id_is_heard() -> None:
    """A plaintext client, a client that names another node's id, and a
    client that expects another server key deliver nothing; the plane
    keeps serving, and each message it does deliver names its true sender."""
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        with (
            raw_socket(zmq.DEALER, b, encrypted=False) as plaintext,
            raw_socket(zmq.DEALER, b, claim=a.keys.node_id) as impostor,
        ):
            wrong_server = zmq.Context.instance().socket(zmq.DEALER)
            wrong_server.setsockopt(zmq.LINGER, 0)
            keys = new_keys()
            wrong_server.setsockopt(zmq.CURVE_PUBLICKEY, keys.curve_public)
            wrong_server.setsockopt(zmq.CURVE_SECRETKEY, keys.curve_secret)
            wrong_server.setsockopt(zmq.CURVE_SERVERKEY, new_keys().curve_public)
            wrong_server.connect(b.address)
            try:
                for sock in (plaintext, impostor, wrong_server):
                    with trio.fail_after(WAIT_S):  # a DEALER takes a message once it connected
                        while True:
                            try:
                                sock.send(b"forged", zmq.NOBLOCK)
                                break
                            except zmq.Again:
                                await trio.sleep(0.01)
                with trio.fail_after(WAIT_S):
                    while drops["control.unauthenticated"] < 1:
                        await trio.sleep(0.01)
                a.send(b.address, [b"genuine"], peer=b.keys.node_id)
                with trio.fail_after(WAIT_S):
                    delivery = await b.receive()
                assert delivery.frames == [b"genuine"] and delivery.peer == a.keys.node_id
                await trio.sleep(0.2)  # time for anything forged to arrive
                assert b.received_messages == 1
            finally:
                wrong_server.close(linger=0)


async def test_a_send_naming_the_wrong_node_never_reaches_the_address() -> None:
    """The server key follows from the id a send names: a node that does
    not hold that id's secret never completes the handshake."""
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops, config=PlaneConfig(unreachable_after_s=0.5)) as (a, b):
        a.send(b.address, [b"for someone else"], peer=STRANGER)
        with trio.fail_after(WAIT_S):
            while drops["control.unreachable"] < 1:
                await trio.sleep(0.02)
        assert b.received_messages == 0
        a.send(b.address, [b"for b"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"for b"]


async def test_a_private_policy_refuses_keys_at_the_handshake() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(3, drops, config=PlaneConfig(unreachable_after_s=0.5)) as (a, b, c):
        allowed = {a.keys.curve_public}
        b.admit(lambda key: key in allowed)
        a.send(b.address, [b"invited"], peer=b.keys.node_id)
        c.send(b.address, [b"not invited"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"invited"]
            while drops["control.handshake_refused"] < 1:
                await trio.sleep(0.02)
        assert b.received_messages == 1


async def test_a_policy_that_raises_refuses_and_the_handler_keeps_answering() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(3, drops, config=PlaneConfig(unreachable_after_s=0.5)) as (a, b, c):
        allowed = a.keys.curve_public

        def buggy(key: bytes) -> bool:
            if key == allowed:
                return True
            raise RuntimeError("a bug in the policy")

        b.admit(buggy)
        c.send(b.address, [b"refused"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            while drops["control.handshake_refused"] < 1:
                await trio.sleep(0.02)
        a.send(b.address, [b"still answered"], peer=b.keys.node_id)
        with trio.fail_after(WAIT_S):
            assert (await b.receive()).frames == [b"still answered"]


# --- the Sybil bound at the handshake ---------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _received(plane: Plane) -> bytes:
    with trio.fail_after(WAIT_S):
        return (await plane.receive()).frames[0]


async def _counted(drops: collections.Counter[str], reason: str, at_least: int = 1) -> None:
    with trio.fail_after(WAIT_S):
        while drops[f"control.{reason}"] < at_least:
            await trio.sleep(0.02)


async def test_new_keys_are_bounded_per_source_address_and_prefix_at_the_handshake() -> None:
    """Real handshakes from real loopback sources: one new key per address
    and two per /24 here. Keys over the bound are refused and counted by
    reason; a key already admitted connects again freely; a refused one
    gets in on a later connection once the bucket has refilled."""
    drops: collections.Counter[str] = collections.Counter()
    clock = FakeClock()
    gate = HandshakeGate(NewcomerLimit(1, 2), clock=clock)
    first, second, third, fourth = (new_keys() for _ in range(4))
    async with planes(1, drops, config=PlaneConfig(unreachable_after_s=0.5)) as (b,):
        b.limit_newcomers(gate)
        with raw_socket(zmq.DEALER, b, keys=first, source="127.0.0.1") as one:
            one.send(b"first")
            assert await _received(b) == b"first"
            with raw_socket(zmq.DEALER, b, keys=second, source="127.0.0.1") as same_host:
                try_send(same_host, b"second")  # refused: never delivered
                await _counted(drops, R_ADDRESS)
                with raw_socket(zmq.DEALER, b, keys=third, source="127.0.0.2") as neighbour:
                    neighbour.send(b"third")
                    assert await _received(b) == b"third"
                with raw_socket(zmq.DEALER, b, keys=fourth, source="127.0.0.3") as third_host:
                    try_send(third_host, b"fourth")
                    await _counted(drops, R_PREFIX)
                # An admitted key is known: a new connection of its own is
                # not charged, though its address has no budget left.
                with raw_socket(zmq.DEALER, b, keys=first, source="127.0.0.1") as again:
                    again.send(b"first again")
                    assert await _received(b) == b"first again"
                assert b.received_messages == 3
        # A minute on, the bucket has refilled: the refused key's next
        # connection (a plane makes one on a later send, having given up on
        # the refused one like on any failing peer) gets in.
        clock.now += 60.0
        with raw_socket(zmq.DEALER, b, keys=second, source="127.0.0.1") as same_host:
            same_host.send(b"second, a minute on")
            assert await _received(b) == b"second, a minute on"


async def test_a_key_membership_vouched_for_is_let_in_without_budget() -> None:
    drops: collections.Counter[str] = collections.Counter()
    gate = HandshakeGate(NewcomerLimit(1, 1), clock=FakeClock())
    member = new_keys()
    gate.vouch(member.curve_public)
    async with planes(1, drops, config=PlaneConfig(unreachable_after_s=0.5)) as (b,):
        b.limit_newcomers(gate)
        with raw_socket(zmq.DEALER, b) as newcomer:
            newcomer.send(b"newcomer")
            assert await _received(b) == b"newcomer"
        with raw_socket(zmq.DEALER, b, keys=member) as known:
            known.send(b"member")
            assert await _received(b) == b"member"
        with raw_socket(zmq.DEALER, b) as late:
            try_send(late, b"late")
            await _counted(drops, R_ADDRESS)
    assert b.received_messages == 2


async def test_the_key_policy_refuses_first_and_a_refused_key_is_not_charged() -> None:
    """A private swarm's policy refusing a key is `handshake_refused` and
    takes nothing from the source's newcomer budget."""
    drops: collections.Counter[str] = collections.Counter()
    gate = HandshakeGate(NewcomerLimit(1, 1), clock=FakeClock())
    invited = new_keys()
    async with planes(1, drops, config=PlaneConfig(unreachable_after_s=0.5)) as (b,):
        b.admit(lambda key: key == invited.curve_public)
        b.limit_newcomers(gate)
        with raw_socket(zmq.DEALER, b) as uninvited:
            try_send(uninvited, b"uninvited")
            await _counted(drops, "handshake_refused")
        with raw_socket(zmq.DEALER, b, keys=invited) as guest:
            guest.send(b"invited")
            assert await _received(b) == b"invited"
    assert drops[f"control.{R_ADDRESS}"] == 0


async def test_one_key_is_one_id_its_sign_bit_twin_is_refused_on_every_plane() -> None:
    """The secret behind an id also signs as its sign-bit twin, and the
    handshake proves the same key for both. The first id to prove the key
    keeps it; the twin is heard on neither plane sharing the gate, so it is
    never a second member for the price of one newcomer."""
    drops: collections.Counter[str] = collections.Counter()
    gate = HandshakeGate(NewcomerLimit(1, 1), clock=FakeClock())
    holder = new_keys()
    twin = curve_twin(holder.node_id)
    assert twin != holder.node_id
    async with planes(2, drops, config=PlaneConfig(unreachable_after_s=0.5)) as (b, c):
        for plane in (b, c):
            plane.limit_newcomers(gate)
        with raw_socket(zmq.DEALER, b, keys=holder) as itself:
            itself.send(b"as itself")
            assert await _received(b) == b"as itself"
        for count, plane in enumerate((b, c), start=1):
            with raw_socket(zmq.DEALER, plane, keys=holder, claim=twin) as as_twin:
                try_send(as_twin, b"as its twin")
                await _counted(drops, "unauthenticated", count)
        with raw_socket(zmq.DEALER, c, keys=holder) as itself:
            itself.send(b"as itself, on the other plane")
            assert await _received(c) == b"as itself, on the other plane"
    assert (b.received_messages, c.received_messages) == (1, 1)
