"""The ZeroMQ transport, over real sockets on 127.0.0.1 (no mocks).

Every wait is bounded by trio.fail_after so a regression fails fast instead
of hanging the suite.
"""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager

import pytest
import trio
import zmq

from mesh.transport import (
    CONTROL_MAX_MESSAGE_BYTES,
    DATA_MAX_MESSAGE_BYTES,
    Plane,
    PlaneConfig,
    open_plane,
    open_planes,
)

LOCAL = "tcp://127.0.0.1:0"
# Generous for loopback, where everything here takes milliseconds.
WAIT_S = 5.0


def total_drops(drops: collections.Counter[str], prefix: str = "") -> int:
    return sum(n for key, n in drops.items() if key.startswith(prefix))


@asynccontextmanager
async def planes(
    n: int,
    drops: collections.Counter[str],
    *,
    max_message_bytes: int = CONTROL_MAX_MESSAGE_BYTES,
    config: PlaneConfig | None = None,
) -> AsyncIterator[list[Plane]]:
    """``n`` control planes on loopback ports, all counting into ``drops``."""
    async with AsyncExitStack() as stack:
        opened = [
            await stack.enter_async_context(
                open_plane(
                    LOCAL,
                    name="control",
                    max_message_bytes=max_message_bytes,
                    drops=drops,
                    config=config,
                )
            )
            for _ in range(n)
        ]
        yield opened


@contextmanager
def raw_socket(kind: int, address: str, routing_id: bytes | None = None) -> Iterator[zmq.Socket]:
    """A plain pyzmq socket connected to ``address``, for sending junk."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.CONNECT_ROUTING_ID, routing_id)
    sock.connect(address)
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
        a.send(a.address, [b"hello", memoryview(body)])
        body[:] = b"WORLD"  # the receiver got its own copy
        advertised = "tcp://192.0.2.7:7001"  # a name only this plane knows itself by
        a.add_own_address(advertised)
        a.send(advertised, [b"advertised"])
        with trio.fail_after(WAIT_S):
            assert await a.receive() == [b"hello", b"world"]
            assert await a.receive() == [b"advertised"]
        assert a.peer_count == 0  # no connection was made
        assert a.sent_messages == a.received_messages == 2
    assert not drops


async def test_a_handler_takes_messages_from_the_reader_until_it_is_cleared() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        a.send(b.address, [b"queued before"])
        with trio.fail_after(WAIT_S):
            while b.received_messages < 1:
                await trio.sleep(0.01)
        handled: list[list[bytes]] = []
        b.deliver_to(handled.append)
        a.send(b.address, [b"to the handler", b"2"])
        with trio.fail_after(WAIT_S):
            while not handled:
                await trio.sleep(0.01)
            assert handled == [[b"to the handler", b"2"]]
            assert await b.receive() == [b"queued before"]  # stays queued
        b.deliver_to(None)
        a.send(b.address, [b"queued again"])
        with trio.fail_after(WAIT_S):
            assert await b.receive() == [b"queued again"]
        assert len(handled) == 1
    assert not drops


async def test_two_planes_exchange_multiframe_messages_both_ways() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        assert a.address != b.address
        assert a.address.startswith("tcp://127.0.0.1:") and not a.address.endswith(":0")
        body = os.urandom(10_000)
        a.send(b.address, [b"header", memoryview(body), b""])
        b.send(a.address, [b"reply", b"second", b"third"])
        with trio.fail_after(WAIT_S):
            assert await b.receive() == [b"header", body, b""]
            assert await a.receive() == [b"reply", b"second", b"third"]
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
        a.send(b.address, [b"first"])
        with trio.fail_after(WAIT_S):
            assert await b.receive() == [b"first"]
        assert a.peer_count == 1
    assert not drops


async def test_burst_of_1000_all_arrive_or_are_counted() -> None:
    drops: collections.Counter[str] = collections.Counter()
    count = 1000
    async with planes(2, drops) as (a, b):
        for i in range(count):
            a.send(b.address, [b"burst", i.to_bytes(4, "big")])
        seen: list[int] = []
        with trio.fail_after(WAIT_S):
            while len(seen) + total_drops(drops) < count:
                with trio.move_on_after(0.05):
                    frames = await b.receive()
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
            a.send(nowhere, [b"into the void", bytes([i])])
        with trio.fail_after(WAIT_S):
            while total_drops(drops) < attempts:
                await trio.sleep(0.02)
        # hwm messages waited in the pipe and were dropped when we gave up on
        # the peer; the rest never fit in it.
        assert drops["control.unreachable"] == hwm
        assert drops["control.peer_queue_full"] == attempts - hwm
        assert a.peer_count == 0, "an unreachable peer is disconnected and forgotten"
        a.send(b.address, [b"still alive"])
        with trio.fail_after(WAIT_S):
            assert await b.receive() == [b"still alive"]


async def test_bad_addresses_are_counted_not_raised() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        a.send("nonsense", [b"x"])
        a.send("tcp://127.0.0.1", [b"x"])  # no port
        a.send("tcp://" + "h" * 300 + ":1", [b"x"])  # too long for a routing id
        a.send(b.address, [b"fine"])
        with trio.fail_after(WAIT_S):
            assert await b.receive() == [b"fine"]
        assert drops["control.bad_address"] == 3
        with pytest.raises(ValueError):
            a.send(b.address, [])
        with pytest.raises(TypeError):
            a.send(b.address, ["text is not bytes"])  # type: ignore[list-item]


async def test_oversized_messages_are_refused_and_the_plane_keeps_serving() -> None:
    drops: collections.Counter[str] = collections.Counter()
    cap = 1024
    async with planes(2, drops, max_message_bytes=cap) as (a, b):
        # Our own sender refuses at once rather than make the peer drop the
        # whole connection.
        a.send(b.address, [b"x" * (cap + 1)])
        assert drops["control.oversized"] == 1

        with (
            raw_socket(zmq.DEALER, b.address) as big,
            raw_socket(zmq.DEALER, b.address) as split,
        ):
            # One frame over MAXMSGSIZE: libzmq drops that connection.
            big.send(b"y" * (cap * 4), zmq.NOBLOCK)
            # Frames each under the cap but together over it: the plane drops
            # the message and counts it; the connection stays.
            split.send_multipart([b"a" * 600, b"b" * 600, b"c"], zmq.NOBLOCK)
            split.send_multipart([b"marker"], zmq.NOBLOCK)
            with trio.fail_after(WAIT_S):
                assert await b.receive() == [b"marker"]
            assert drops["control.oversized"] == 2

            # Another sender still gets through.
            a.send(b.address, [b"normal"])
            with trio.fail_after(WAIT_S):
                assert await b.receive() == [b"normal"]
            # And the refused sender, once reconnected, is served again.
            big.send(b"small now", zmq.NOBLOCK)
            with trio.fail_after(WAIT_S):
                assert await b.receive() == [b"small now"]


async def test_garbage_from_raw_sockets_does_not_break_the_plane() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with planes(2, drops) as (a, b):
        junk = [os.urandom(n) for n in (0, 1, 17, 300)]
        with (
            raw_socket(zmq.ROUTER, b.address, routing_id=b"peer") as router,
            raw_socket(zmq.DEALER, b.address) as dealer,
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
                a.send(b.address, [b"after the junk"])
                received: list[list[bytes]] = []
                wanted = (junk, [b""] * 5, [b"after the junk"])
                while not all(message in received for message in wanted):
                    received.append(await b.receive())
        # The plane passes frames through untouched (validation is the wire
        # layer's job) and keeps serving its real peers.
        a.send(b.address, [b"still serving"])
        with trio.fail_after(WAIT_S):
            while await b.receive() != [b"still serving"]:
                pass


async def test_peer_table_is_bounded_and_reconnects_after_eviction() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with (
        planes(1, drops, config=PlaneConfig(max_peers=2)) as (a,),
        planes(3, drops) as targets,
    ):
        with trio.fail_after(WAIT_S):
            for target in targets:
                a.send(target.address, [b"hello"])
                assert await target.receive() == [b"hello"]
                assert a.peer_count <= 2
            # The first target was evicted; sending again reconnects with a
            # fresh routing id (reusing the old one would abort libzmq).
            a.send(targets[0].address, [b"again"])
            assert await targets[0].receive() == [b"again"]
        assert a.peer_count == 2
    assert not drops


async def test_open_planes_gives_separate_control_and_data_planes() -> None:
    drops: collections.Counter[str] = collections.Counter()
    async with (
        open_planes(LOCAL, LOCAL, drops=drops) as (control, data),
        open_planes(LOCAL, LOCAL, drops=drops) as (control2, data2),
    ):
        assert (control.name, data.name) == ("control", "data")
        assert control.max_message_bytes == CONTROL_MAX_MESSAGE_BYTES
        assert data.max_message_bytes == DATA_MAX_MESSAGE_BYTES
        activation = os.urandom(8 * 1024 * 1024)  # over the control cap
        control.send(control2.address, [activation])
        data.send(data2.address, [b"header", activation])
        control.send(control2.address, [b"probe"])
        with trio.fail_after(WAIT_S):
            assert await control2.receive() == [b"probe"]
            assert await data2.receive() == [b"header", activation]
        assert drops == collections.Counter({"control.oversized": 1})


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
            open_plane(LOCAL, name="control", max_message_bytes=1024, drops=drops) as plane,
        ):
            nursery.start_soon(reader, plane)
            plane.send(dead_address(), [b"queued, then discarded on close"])
            await trio.sleep(0.05)
        assert outcome == ["end of channel"]
        assert plane.closed
        plane.send(plane.address, [b"late"])  # never raises
        assert drops["control.closed"] == 1
        # The listen port is released: the same endpoint binds again. libzmq
        # closes the listener on its I/O thread just after close() returns,
        # so allow it a moment.
        while True:
            try:
                async with open_plane(
                    plane.address, name="control", max_message_bytes=1024, drops=drops
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
        PlaneConfig(heartbeat_ttl_ms=10_000_000)
    with pytest.raises(ValueError):
        PlaneConfig(reconnect_ivl_ms=500, reconnect_ivl_max_ms=100)
