"""The held-bytes guard's driver on real loopback TCP sockets (`mesh.held_guard`):
what it reads off a socket, that it cuts only the connection it measured,
and that it stands down when it cannot see every take."""

from __future__ import annotations

import collections
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from mesh.held_bytes import HeldBytes
from mesh.held_guard import HeldGuard, IoThreads, bytes_read

MIB = 1024 * 1024


@contextmanager
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the accepted end, the client end) of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    with accepted, client:
        yield accepted, client


def read_exactly(sock: socket.socket, count: int) -> None:
    while count:
        count -= len(sock.recv(min(count, 65536)))


def pour(sender: socket.socket, receiver: socket.socket, count: int) -> None:
    """Send `count` bytes and read them at the other end, a piece at a time
    (never more than the kernel's buffers hold at once)."""
    for _ in range(count // 65536):
        sender.sendall(bytes(65536))
        read_exactly(receiver, 65536)


def guard(drops: collections.Counter[str]) -> HeldGuard:
    return HeldGuard("data", HeldBytes(MIB, 2 * MIB), lambda reason: drops.update([reason]))


def test_bytes_read_counts_what_the_process_read_not_what_waits_in_the_kernel() -> None:
    with connection() as (accepted, client):
        fd = accepted.fileno()
        client.sendall(bytes(60_000))
        read_exactly(accepted, 20_000)
        assert bytes_read(fd) == 20_000
        read_exactly(accepted, 40_000)
        assert bytes_read(fd) == 60_000
    assert bytes_read(fd) is None  # closed: no socket there


def test_a_connection_holding_past_the_limit_is_shut_down_and_others_are_not() -> None:
    drops: collections.Counter[str] = collections.Counter()
    held = guard(drops)
    with connection() as (flooded, flooder), connection() as (quiet, talker):
        held.opened(flooded.fileno())
        held.opened(quiet.fileno())
        pour(flooder, flooded, 2 * MIB)  # read, and never taken by any plane
        talker.sendall(b"hello")
        read_exactly(quiet, 5)
        held.took(quiet.fileno(), 5, frames=1)
        assert held.check(now=0.0) == 1
        assert flooded.recv(1) == b""  # shut down under its owner
        talker.sendall(b"still here")
        assert quiet.recv(64) == b"still here"
    assert drops == collections.Counter({"held_cut": 1})


def test_a_number_that_now_names_another_connection_is_not_cut() -> None:
    """libzmq may close a connection and reuse its fd before the guard
    hears: it checks both ends' addresses before it shuts anything down."""
    drops: collections.Counter[str] = collections.Counter()
    held = guard(drops)
    with connection() as (reused, sender):
        held._connections[reused.fileno()] = (socket.AF_INET, ("127.0.0.1", 1), ("127.0.0.1", 2))
        held.ledger.opened(reused.fileno(), 0)
        pour(sender, reused, 2 * MIB)
        assert held.check(now=0.0) == 0
        sender.sendall(b"x")
        assert reused.recv(1) == b"x"
    assert not drops


def test_a_take_with_no_source_stands_the_guard_down() -> None:
    held = guard(collections.Counter())
    held.took(-1, 100, frames=1)
    assert held.off is not None


def test_the_io_threads_cpu_time_grows_with_what_they_read() -> None:
    """The tripwire between readings: libzmq's I/O threads of this process
    are found by name, and their CPU time grows when they move bytes."""
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    io = IoThreads()
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"once")  # a round trip: the I/O thread runs, and has named itself
        pull.recv()
        io.find()
        before = io.cpu_ns()
        assert before is not None
        for _ in range(20):
            push.send(bytes(MIB))
            pull.recv()
        after = io.cpu_ns()
        assert after is not None and after - before > 50_000
    finally:
        io.close()
        for sock in (pull, push):
            sock.close(linger=0)
        context.term()
