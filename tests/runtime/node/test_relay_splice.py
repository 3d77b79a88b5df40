"""A relay on real sockets, on loopback: a node "behind" it holds a
reservation, a third party dials the relayed addresses with CURVE ZeroMQ
and its messages arrive on the node's own planes with the third party's
proved id, and an HTTP client gets the node's API through the relayed API
port; a relay that dies ends
the reservation; bad input is refused, counted, and the relay keeps serving."""

from __future__ import annotations

import collections
from contextlib import AbstractAsyncContextManager

import httpx
import trio

from mesh.identity import Identity
from mesh.relay import MAX_LINE_BYTES, PLANES, Plane, encode_line
from mesh.transport import Plane as ZmqPlane
from mesh.transport import open_planes
from runtime.node.hostport import HostPort, parse_hostport
from runtime.node.relay_client import RelayRefused, hold_reservation
from runtime.node.relay_server import RelayServer
from runtime.node.relays import relayed_api

SECRET = b"only the two peers may read this " * 8
TIMEOUT_S = 10.0


def loopback_planes(
    identity: Identity, drops: collections.Counter[str]
) -> AbstractAsyncContextManager[tuple[ZmqPlane, ZmqPlane]]:
    """A node's two CURVE planes on free loopback ports."""
    return open_planes(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", drops=drops, keys=identity.plane_keys()
    )


async def test_a_third_party_speaks_curve_zeromq_to_a_relayed_node_end_to_end() -> None:
    behind, dialer = Identity.generate(), Identity.generate()
    relay = RelayServer("127.0.0.1", 0)
    drops: collections.Counter[str] = collections.Counter()
    counters: collections.Counter[str] = collections.Counter()
    async with (
        trio.open_nursery() as nursery,
        loopback_planes(behind, drops) as (control, data),
        loopback_planes(dialer, drops) as (their_control, their_data),
    ):
        port = await nursery.start(relay.run)
        relayed: dict[Plane, HostPort] = {}
        seen_as: list[str] = []
        local: dict[Plane, HostPort] = {
            "control": parse_hostport(control.address),
            "data": parse_hostport(data.address),
            "api": HostPort("127.0.0.1", await nursery.start(serve_api)),
        }

        nursery.start_soon(
            hold_reservation,
            behind,
            f"tcp://127.0.0.1:{port}",
            local,
            lambda ports, seen: relayed.update(ports) or seen_as.append(seen),
            counters,
        )
        with trio.fail_after(TIMEOUT_S):
            while not relayed:
                await trio.sleep(0.01)
        assert relayed["control"].zmq() != control.address
        assert seen_as == ["127.0.0.1"], "the relay says where it saw the node come from"
        with trio.fail_after(TIMEOUT_S):
            their_control.send(relayed["control"].zmq(), [b"hello", SECRET], peer=behind.node_id)
            got = await control.receive()
            their_data.send(relayed["data"].zmq(), [SECRET], peer=behind.node_id)
            got_data = await data.receive()
            async with httpx.AsyncClient() as client:
                answer = await client.get(relayed["api"].http() + "/v1/models")
        assert got.peer == dialer.node_id, "the id the CURVE handshake proved, through the relay"
        assert got.frames == [b"hello", SECRET]
        assert got_data.peer == dialer.node_id and got_data.frames[-1].endswith(SECRET)
        assert answer.status_code == 200 and answer.text == "GET /v1/models"
        status = relay.status()
        assert status["reservations"] == 1 and status["sessions"] == 3
        assert status["forwarded_bytes"] > len(SECRET)
        nursery.cancel_scope.cancel()


async def serve_api(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """The node's API: an HTTP/1.1 server answering each request with its
    own request line, on a free loopback port (`started(port)`)."""

    async def answer(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(4096)
        body = head.split(b"\r\n", 1)[0].rsplit(b" ", 1)[0]
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        await stream.send_all(reply % (len(body), body))
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(answer, listeners)


async def read_to_end(stream: trio.SocketStream) -> None:
    """HELLO, perhaps REFUSED, then the relay closes (a reset, if it left
    our garbage unread)."""
    try:
        while await stream.receive_some(1024):
            pass
    except trio.BrokenResourceError:
        pass


def nowhere() -> dict[Plane, HostPort]:
    """Local planes for a reservation nobody dials."""
    return {plane: HostPort("127.0.0.1", 1) for plane in PLANES}


async def test_garbage_oversized_and_unknown_tokens_are_refused_and_counted() -> None:
    relay = RelayServer("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay.run)
        for payload in (
            b"\xff\x00garbage\n",
            b"A" * (MAX_LINE_BYTES + 10),
            encode_line("ACCEPT", bytes(16)),
            # A real key with a signature it did not make, and the all-zero
            # (small-order) key OpenSSL once let sign a zero signature.
            encode_line("RESERVE", Identity.generate().node_id, bytes(64)),
            encode_line("RESERVE", bytes(32), bytes(64)),
        ):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(payload)
            with trio.fail_after(TIMEOUT_S):
                await read_to_end(stream)
            await stream.aclose()
        counters = relay.book.counters
        assert counters["refused_garbage"] == 1
        assert counters["refused_oversized"] == 1
        assert counters["refused_unknown_token"] == 1
        assert counters["refused_bad_signature"] == 2
        # Still serving: a real reservation goes through.
        got: list[str] = []
        identity = Identity.generate()
        nursery.start_soon(
            hold_reservation,
            identity,
            f"tcp://127.0.0.1:{port}",
            nowhere(),
            lambda ports, seen: got.append(ports["control"].zmq()),
            collections.Counter(),
        )
        with trio.fail_after(TIMEOUT_S):
            while not got:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_a_full_relay_refuses_a_reservation_with_its_reason() -> None:
    relay = RelayServer("127.0.0.1", 0)
    relay.book.max_reservations = 0
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay.run)
        try:
            with trio.fail_after(TIMEOUT_S):
                await hold_reservation(
                    Identity.generate(),
                    f"tcp://127.0.0.1:{port}",
                    nowhere(),
                    lambda ports, seen: None,
                    collections.Counter(),
                )
        except RelayRefused as exc:
            assert "reservations_full" in str(exc)
        else:
            raise AssertionError("a full relay took a reservation")
        nursery.cancel_scope.cancel()


def test_the_api_is_relayed_only_when_it_listens_beyond_loopback() -> None:
    url = "http://10.77.3.2:41295"
    assert relayed_api(HostPort("10.77.3.2", 0), url) == HostPort("10.77.3.2", 41295)
    assert relayed_api(HostPort("0.0.0.0", 0), url) == HostPort("127.0.0.1", 41295)
    for kept_local in ("127.0.0.1", "::1", "localhost"):
        assert relayed_api(HostPort(kept_local, 0), url) is None
