"""Cut a connection that makes libzmq hold what its plane never gets (issue 30).

The I/O half of `mesh.held_bytes`. A plane tells its guard of each
connection libzmq opens (the monitors' ACCEPTED and CONNECTED events carry
its fd) and of each message it takes (the message's source fd, libzmq's
`SRCFD`). The guard's task reads, for every connection, how much libzmq has
read off the socket: the kernel's count of bytes received (`TCP_INFO`)
less what still waits in the socket (`FIONREAD`). A connection the ledger
names is shut down under libzmq (`shutdown(2)` on the same socket): libzmq
sees the connection end, frees the half-received message, and the peer may
reconnect, a new connection that starts from nothing. Reading every 20 ms,
every 5 ms while anything is held (a flood fills at about 400 MB/s on
loopback, measured), bounds what the ledger's limits let through. An
interval in which libzmq's I/O threads hardly ran (their CPU time,
`IoThreads`) skips its reading: no connection can have brought much in.
Where the kernel reports no byte counts (before Linux 4.1), or libzmq no
source fd (`SRCFD` is deprecated), the guard stands down rather than guess.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import trio

from mesh.held_bytes import HeldBytes

__all__ = ["BUSY_POLL_S", "POLL_S", "HeldGuard", "IoThreads", "bytes_read", "guard"]

log = logging.getLogger(__name__)

POLL_S: Final = 0.02
"""Between readings while nothing is held: about 40 syscalls a second per
connection, and at most what a flood reads in 20 ms before it is seen."""
BUSY_POLL_S: Final = 0.005
"""Between readings while some connection holds more than `BUSY_HELD_BYTES`."""
BUSY_HELD_BYTES: Final = 256 * 1024
IO_QUIET_NS: Final = 50_000
"""libzmq's I/O threads' CPU time between two readings under which nothing
is read: 50 us decrypts and frames about 50 KiB, far below any limit (an
idle node's heartbeats and gossip take a few us). A flood of any size
costs more, and is read within one interval."""
FULL_READING_S: Final = 1.0
"""Every connection is read at least this often even when the I/O threads
were quiet: closed connections leave, and what is held decays."""

_TCP_INFO_BYTES: Final = 136
_BYTES_RECEIVED: Final = struct.Struct("=Q")
_BYTES_RECEIVED_AT: Final = 128
"""`tcpi_bytes_received` in Linux's `struct tcp_info` (since 4.1)."""
_INT: Final = struct.Struct("=i")

_Identity = tuple[int, object, object]  # (family, our address, the peer's) of a TCP connection


@contextmanager
def _borrowed(fd: int, family: int | None = None) -> Iterator[socket.socket | None]:
    """libzmq's socket `fd` wrapped for a moment (None: no such socket),
    and let go again, never closed. Naming its `family` spares the
    wrapper asking the kernel."""
    try:
        if family is None:
            sock = socket.socket(fileno=fd)
        else:
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fd)
    except (OSError, ValueError):  # no such fd, or not a socket
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()


def bytes_read(fd: int, family: int | None = None) -> int | None:
    """How many bytes the process has read off TCP socket `fd` so far;
    None if `fd` is no TCP socket with byte counts (closed, reused, old
    kernel)."""
    with _borrowed(fd, family) as sock:
        if sock is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            (unread,) = _INT.unpack(fcntl.ioctl(fd, termios.FIONREAD, bytes(_INT.size)))
        except OSError:
            return None
    if len(info) < _BYTES_RECEIVED_AT + _BYTES_RECEIVED.size:
        return None
    (received,) = _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)
    return int(received) - unread


def _identity(fd: int) -> _Identity | None:
    with _borrowed(fd) as sock:
        if sock is None or sock.type != socket.SOCK_STREAM:
            return None
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            return sock.family, sock.getsockname(), sock.getpeername()
        except OSError:
            return None


def _shut_down(fd: int, identity: _Identity) -> bool:
    """Shut `fd`'s connection down, if `fd` is still that connection (a
    number libzmq closed and reused names another)."""
    if _identity(fd) != identity:
        return False
    with _borrowed(fd, identity[0]) as sock:
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


class IoThreads:
    """CPU time so far of libzmq's I/O threads in this process (named
    `ZMQbg/IO/<n>` by libzmq on Linux), from their `schedstat`; None where
    there is no such thread or file (then every interval reads). A thread
    names itself once it runs, so `find` is worth repeating while none is
    found."""

    def __init__(self) -> None:
        self._files: list[int] = []
        self.find()

    def find(self) -> None:
        """Look for the threads (again)."""
        self.close()
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return
        for task in tasks:
            try:
                with open(f"/proc/self/task/{task}/comm") as comm:
                    if not comm.read().startswith("ZMQbg/IO/"):
                        continue
                self._files.append(os.open(f"/proc/self/task/{task}/schedstat", os.O_RDONLY))
            except OSError:
                continue

    def cpu_ns(self) -> int | None:
        if not self._files:
            return None
        try:
            return sum(int(os.pread(fd, 64, 0).split()[0]) for fd in self._files)
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        for fd in self._files:
            os.close(fd)
        self._files = []


class HeldGuard:
    """One plane's guard: the ledger, the connections' identities, the task."""

    def __init__(self, name: str, ledger: HeldBytes, drop: Callable[[str], None]) -> None:
        self.name = name
        self.ledger = ledger
        self._drop = drop
        self._connections: dict[int, _Identity] = {}
        self.off: str | None = None
        """Why the guard stood down (None: it guards)."""

    def opened(self, fd: int) -> None:
        identity = _identity(fd)
        read = None if identity is None else bytes_read(fd, identity[0])
        if identity is None or read is None:
            return
        self._connections[fd] = identity
        self.ledger.opened(fd, read)

    def closed(self, fd: int) -> None:
        self._connections.pop(fd, None)
        self.ledger.closed(fd)

    def took(self, fd: int, payload_bytes: int, frames: int) -> None:
        if fd < 0:  # libzmq gave no source: every take would look held
            self.stand_down("libzmq gives no message's source fd")
        self.ledger.took(fd, payload_bytes, frames)

    def stand_down(self, why: str) -> None:
        """Stop cutting: without every take counted, honest connections
        would look as if they held what the plane took."""
        if self.off is None:
            self.off = why
            log.warning("%s plane: no held-bytes guard: %s", self.name, why)

    def check(self, now: float) -> int:
        """Read every connection, cut those the ledger names; how many."""
        for fd, (family, *_) in list(self._connections.items()):
            read = bytes_read(fd, family)
            if read is None:
                self.closed(fd)
            else:
                self.ledger.read(fd, read, now)
        cut = 0
        for fd in self.ledger.to_cut():
            identity = self._connections.pop(fd, None)
            if identity is not None and _shut_down(fd, identity):
                cut += 1
                self._drop("held_cut")
                log.warning(
                    "%s plane: cut the connection from %s: it made libzmq hold more of an"
                    " unfinished message than any peer may (docs/design/transport.md#byte-budgets)",
                    self.name,
                    identity[2],
                )
        return cut

    def busy(self) -> bool:
        """Whether some connection holds enough to be read more often."""
        return self.ledger.largest() > BUSY_HELD_BYTES


async def guard(*guards: HeldGuard) -> None:
    """Run ``guards`` (a node's two planes') in one task, so that a node
    wakes once per interval, not once per plane, and reads its connections
    only when libzmq's I/O threads ran (`IO_QUIET_NS`), something is held,
    or `FULL_READING_S` passed."""
    io = IoThreads()
    try:
        busy, io_ns, full_at = True, io.cpu_ns(), trio.current_time()
        while guarding := [held for held in guards if held.off is None]:
            await trio.sleep(BUSY_POLL_S if busy else POLL_S)
            now, was = trio.current_time(), io_ns
            io_ns = io.cpu_ns()
            quiet = io_ns is not None and was is not None and io_ns - was < IO_QUIET_NS
            if quiet and not busy and now - full_at < FULL_READING_S:
                continue
            full_at, busy = now, False
            if io_ns is None:
                io.find()
            for held in guarding:
                held.check(now)
                busy = busy or held.busy()
    finally:
        io.close()
