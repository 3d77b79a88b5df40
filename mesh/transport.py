"""ZeroMQ transport: one-way datagrams between nodes, driven from trio.

A *plane* is a pair of ROUTER sockets: inbound, bound on the node's listen
address, and outbound, connected to whichever peers we send to. Messages
are one-way (replies go to the address a sender advertises), and each node
has two planes, control and data, so a 20 MB prefill never sits in front of
a failure-detector probe. Both are CurveZMQ, keyed from the node's identity,
so every message is delivered with the id its handshake proved. `Plane.send`
never blocks or raises for network reasons: what cannot go out is dropped
and counted, because the protocol cores treat the network as lossy. The
data plane is *chunked*: libzmq takes frames of at most one chunk, big
messages travel as chunks (`mesh.chunks`), reassembled only for peers the
plane's owner allows, and every peer's bytes are charged to a budget.

Why one owner task per socket, IMMEDIATE=0, fresh routing ids and the
socket monitor (libzmq behaviour, measured): docs/design/transport.md.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Final, NamedTuple

import trio
import zmq

from mesh import chunks
from mesh.held_bytes import HeldBytes
from mesh.held_guard import HeldGuard, guard
from mesh.identity import NODE_ID_BYTES, PlaneKeys, curve_public_key
from mesh.zap import Admit, HandshakeGate, ZapHandler

__all__ = [
    "CONTROL_MAX_MESSAGE_BYTES",
    "DATA_MAX_MESSAGE_BYTES",
    "DEFAULT_CONTROL_CONFIG",
    "DEFAULT_DATA_CONFIG",
    "Delivery",
    "Plane",
    "PlaneConfig",
    "open_plane",
    "open_planes",
]

# --- limits -----------------------------------------------------------------

# Control carries gossip, Raft and small RPCs. Its largest legitimate message
# is a push-pull of the whole membership state (about 2.3 MB for 1,000 nodes;
# see mesh/wire.py, which caps decoding at the same 4 MiB). Keeping it small
# bounds what one peer can make us allocate, and keeps every control message
# quick to transmit so a probe never waits long behind another message.
CONTROL_MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024

# Data carries activations. A long prefill is tens of MB (e.g. 4,096 tokens x
# 8,192 hidden x 2 bytes = 64 MiB for a 70B-class model); 256 MiB leaves room
# for bigger models and longer prompts. It bounds a *reassembled* message:
# libzmq takes no data-plane frame over one chunk (`mesh.chunks`), and only
# peers the plane's owner allows may send more than that in one message
# (docs/design/transport.md#byte-budgets).
DATA_MAX_MESSAGE_BYTES: Final = 256 * 1024 * 1024

# A ZeroMQ routing id is at most 255 bytes. Ours is the address plus "#" and a
# generation number (up to 20 digits), so addresses must fit in 200 bytes;
# real endpoints ("tcp://[v6 address]:port") are well under 64.
MAX_ADDRESS_BYTES: Final = 200

# The outbound socket should never receive anything: our peers' inbound
# sockets do not send. Only ZMTP commands (handshake, PING/PONG) legitimately
# arrive there; they are tens of bytes (a few hundred with CURVE). 64 KiB is
# far above that and stops a hostile endpoint we connect to from making us
# buffer large frames (the frame is refused and the connection dropped).
OUTBOUND_MAX_FRAME_BYTES: Final = 64 * 1024
# ...and at most this many unread junk messages per connection, after which
# libzmq stops reading that connection (TCP back-pressure on the sender).
OUTBOUND_RCVHWM: Final = 16

# An owner task handles at most this many messages in a row before yielding
# to the scheduler, so a flood on one socket cannot starve the other tasks.
DRAIN_BATCH: Final = 64

# The peer-table sweep runs every unreachable_after_s / 4, clamped to this
# range: often enough that unreachable peers go within ~25% of their limit,
# rarely enough that an idle node does not spin.
MIN_SWEEP_INTERVAL_S: Final = 0.05
MAX_SWEEP_INTERVAL_S: Final = 1.0

# libzmq carries HEARTBEAT_TTL on the wire as a 16-bit count of deciseconds.
MAX_HEARTBEAT_TTL_MS: Final = 6_553_500

# Verified (User-Id, X-Node-Id) pairs a plane remembers, so mapping a peer's
# id to its key (a modular inversion) happens once per peer, not per message.
# Far above the peers one node talks to; a flood of new keys only evicts.
MAX_VERIFIED_PEERS: Final = 4096

# The handshake metadata property that carries the connecting node's id.
NODE_ID_PROPERTY: Final = "X-Node-Id"

# The message property libzmq sets to the IP address a TCP connection comes
# from (the kernel's word, not the peer's: it cannot be claimed).
PEER_ADDRESS_PROPERTY: Final = "Peer-Address"

_HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)

# Monitor events the outbound socket reports. CONNECTED gives the connection's
# fd (to match a later DISCONNECTED); HANDSHAKE_SUCCEEDED means the peer is
# reachable and what we queued has been flushed to it; CONNECT_RETRIED follows
# every failed attempt or lost connection, so it marks a peer as failing.
_MONITORED_EVENTS: Final = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | _HANDSHAKE_FAILED
)
# ...and the inbound socket: each connection's fd, for the held-bytes guard.
_INBOUND_EVENTS: Final = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_MONITOR_HEADER = struct.Struct("=Hi")  # event id (u16), value (i32), no padding

# What an owner task does with each message it reads (frames not copied).
_Deliver = Callable[[list[zmq.Frame]], Awaitable[None]]

# Unique ZAP domains for the planes of one process.
_zap_domains = itertools.count(1)


class Delivery(NamedTuple):
    """One inbound message: the id of the node that sent it (authenticated
    by the handshake) and its frames."""

    peer: bytes
    frames: list[bytes]


def admit_every_key(_key: bytes) -> bool:
    """An open swarm's handshake policy: any key may connect as a member."""
    return True


# --- configuration ------------------------------------------------------------


@dataclass(frozen=True)
class PlaneConfig:
    """Tunables of one plane. Every default is chosen for the control plane
    on a LAN or a decent WAN; :data:`DEFAULT_DATA_CONFIG` adjusts it for big,
    slow frames.

    hwm:
        ZeroMQ high-water mark, in messages, per peer and per direction
        (SNDHWM on outbound pipes, RCVHWM on inbound pipes). Higher absorbs
        bigger bursts; lower bounds memory per slow or dead peer (worst case
        hwm x max message size each) and turns overload into counted drops
        sooner. 1,000 is libzmq's default.
    receive_hwm:
        RCVHWM of inbound pipes where it should differ from ``hwm`` (None:
        ``hwm``). One connection can make libzmq hold receive_hwm x the
        largest frame before TCP back-pressure stops it.
    heartbeat_ivl_ms:
        How often ZMTP PINGs go out on an otherwise quiet connection, so a
        dead pipe is noticed without application traffic. Lower notices
        sooner; each PING is a few bytes per connection per interval.
    heartbeat_timeout_ms:
        How long without any traffic back after a PING before the connection
        is dropped (and, outbound, reconnected). Must exceed the time a PING
        can wait behind our biggest frame on the slowest link; too low tears
        down healthy but busy connections.
    heartbeat_ttl_ms:
        Sent to the peer inside our PINGs: "drop me if you hear nothing for
        this long". Should be a few heartbeat intervals. At most 6,553,500
        (16-bit deciseconds on the wire).
    send_queue:
        Messages :meth:`Plane.send` may queue for the outbound owner task.
        Beyond it, sends are dropped as ``send_queue_full``. The queue only
        absorbs scheduling jitter; per-peer buffering is libzmq's (hwm).
    receive_queue:
        Messages the inbound owner task may hold for :meth:`Plane.receive`.
        When full, the owner stops reading, libzmq's RCVHWM fills and the
        senders' pipes fill: back-pressure, not silent loss.
    max_peers:
        Outbound connections kept at once; the least recently used is
        disconnected beyond it. Each is one TCP connection (one fd here and
        one on the peer), so this must stay well under RLIMIT_NOFILE
        (commonly 1,024 soft); idle peers are also closed (idle_disconnect_s),
        so the live set is usually far smaller.
    unreachable_after_s:
        How long a peer may keep failing to connect before it is
        disconnected and what was queued for it is dropped as
        ``unreachable``. Lower frees resources and reports loss sooner; it
        must exceed a slow handshake over the worst link we serve.
    idle_disconnect_s:
        A peer we have not sent to for this long is disconnected (it is
        reconnected on the next send), so long-running nodes do not hold a
        connection to every address they ever talked to.
    connect_timeout_ms:
        TCP connect timeout (ZMQ_CONNECT_TIMEOUT). Without it a SYN into a
        black hole waits for the OS (minutes) before a retry is reported.
    handshake_ivl_ms:
        Longest a ZMTP handshake may take (ZMQ_HANDSHAKE_IVL); a peer that
        accepts TCP but never speaks ZMTP is dropped after it.
    reconnect_ivl_ms / reconnect_ivl_max_ms:
        First and largest delay between libzmq's reconnect attempts (it
        backs off exponentially between them). Short first retry recovers a
        restarted peer quickly; the cap stops hammering a dead one.
    peer_rate_bytes_per_s / peer_burst_bytes:
        A chunked plane's byte budget per peer (`mesh.chunks.ByteBudgets`):
        what one peer's messages may bring in per second, and at once, unless
        the plane's owner allows it big messages. Only chunked planes use it.
    held_limit_bytes / held_total_bytes:
        The most one connection, and all of them together, may make libzmq
        hold of what the plane has not taken: unread messages and a message
        whose last frame has not come (`mesh.held_bytes`). A connection over
        the first, or the largest stalled holder while the stalled ones hold
        more than the second, is cut (`mesh.held_guard`). The control plane's limit is two of its
        largest messages and a MiB; the data plane's, its receive_hwm
        chunks, the chunk in progress and one more.
    rto_min_ms:
        The least TCP retransmission timeout of the connections this plane
        makes (Linux's per-socket TCP_RTO_MIN_US, kernel 6.15 and later;
        elsewhere the system's 200 ms stays; None: leave it). A decode step
        is one small message each way and nothing follows it, so a lost
        segment waits for the timeout (no duplicate ACKs come to trigger a
        fast retransmit): at 200 ms, 1% loss on each link cost a 40 ms-RTT
        chain 12-17 ms per token. The timeout stays above the measured
        round trip (srtt + 4 x rttvar) whatever this floor says, so a low
        floor only shortens the wait where the path is fast and steady.
    """

    hwm: int = 1000
    receive_hwm: int | None = None
    heartbeat_ivl_ms: int = 1_000
    heartbeat_timeout_ms: int = 5_000
    heartbeat_ttl_ms: int = 10_000
    send_queue: int = 1024
    receive_queue: int = 256
    max_peers: int = 1024
    unreachable_after_s: float = 10.0
    idle_disconnect_s: float = 300.0
    connect_timeout_ms: int = 5_000
    handshake_ivl_ms: int = 10_000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 2_000
    peer_rate_bytes_per_s: float = chunks.PEER_RATE_BYTES_PER_S
    peer_burst_bytes: float = chunks.PEER_BURST_BYTES
    held_limit_bytes: int = 2 * CONTROL_MAX_MESSAGE_BYTES + 1024 * 1024
    held_total_bytes: int = 24 * 1024 * 1024
    rto_min_ms: float | None = 10.0

    def __post_init__(self) -> None:
        positive = {
            "hwm": self.hwm,
            "heartbeat_ivl_ms": self.heartbeat_ivl_ms,
            "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
            "heartbeat_ttl_ms": self.heartbeat_ttl_ms,
            "send_queue": self.send_queue,
            "receive_queue": self.receive_queue,
            "max_peers": self.max_peers,
            "unreachable_after_s": self.unreachable_after_s,
            "idle_disconnect_s": self.idle_disconnect_s,
            "connect_timeout_ms": self.connect_timeout_ms,
            "handshake_ivl_ms": self.handshake_ivl_ms,
            "reconnect_ivl_ms": self.reconnect_ivl_ms,
            "reconnect_ivl_max_ms": self.reconnect_ivl_max_ms,
            "peer_rate_bytes_per_s": self.peer_rate_bytes_per_s,
            "peer_burst_bytes": self.peer_burst_bytes,
            "held_limit_bytes": self.held_limit_bytes,
        }
        for field_name, value in positive.items():
            if value <= 0:
                raise ValueError(f"PlaneConfig.{field_name} must be positive, got {value!r}")
        if self.receive_hwm is not None and self.receive_hwm <= 0:
            raise ValueError(f"PlaneConfig.receive_hwm must be positive, got {self.receive_hwm!r}")
        if self.heartbeat_ttl_ms > MAX_HEARTBEAT_TTL_MS:
            raise ValueError(f"PlaneConfig.heartbeat_ttl_ms must be <= {MAX_HEARTBEAT_TTL_MS}")
        if self.reconnect_ivl_max_ms < self.reconnect_ivl_ms:
            raise ValueError("PlaneConfig.reconnect_ivl_max_ms must be >= reconnect_ivl_ms")
        if self.held_total_bytes < self.held_limit_bytes:
            raise ValueError("PlaneConfig.held_total_bytes must be >= held_limit_bytes")


DEFAULT_CONTROL_CONFIG: Final = PlaneConfig()

# The data plane moves messages of up to 256 MiB (as 1 MiB chunks). A PING
# queued behind one on a 10 MB/s link waits ~25 s, so the heartbeat timeout
# is a minute (a control-plane timeout would cut healthy transfers). SNDHWM
# 1,024 takes the 257 chunks of the largest message beside many streams'
# small decode activations (chunks are views of the sender's buffer: they
# pin nothing more). RCVHWM 4 bounds what one connection can make libzmq
# hold to 4 chunks (4 MiB) before TCP back-pressure holds its sender back:
# eight flooding keys then cost the node about 20 MiB, measured, where 16
# let a busy reader fall 60 MiB behind; a burst past it waits in the
# sender's queue, it is not lost. So an honest connection holds at most
# those 4 chunks and the one in progress: past 6, a peer is sending a
# message of many frames that libzmq keeps whole (mesh/held_guard.py).
# send_queue and receive_queue are smaller because each entry may be large.
DEFAULT_DATA_CONFIG: Final = replace(
    DEFAULT_CONTROL_CONFIG,
    hwm=1024,
    receive_hwm=4,
    held_limit_bytes=6 * chunks.SINGLE_MESSAGE_BYTES,
    heartbeat_ivl_ms=5_000,
    heartbeat_timeout_ms=60_000,
    heartbeat_ttl_ms=60_000,
    send_queue=256,
    receive_queue=64,
    unreachable_after_s=30.0,
)


# --- the plane ----------------------------------------------------------------


@dataclass
class _Peer:
    """What the outbound side knows about one address it connected to."""

    address: str
    node: bytes
    routing_id: bytes
    last_used: float
    # True from a handshake until that connection is lost.
    up: bool = False
    # fd of the current connection (from EVENT_CONNECTED), to ignore a
    # DISCONNECTED that belongs to an earlier connection.
    fd: int | None = None
    # When the peer started failing (first CONNECT_RETRIED while not up).
    down_since: float | None = None
    # Messages handed to libzmq since the peer was last up: if it never comes
    # back these are lost, and we count them when we give up on it.
    queued_while_down: int = 0


def _int_option(sock: zmq.Socket[bytes], option: int) -> int:
    """An integer socket option (FD, EVENTS); pyzmq types every option as
    ``int | bytes``, and these are always ints."""
    value = sock.getsockopt(option)
    if not isinstance(value, int):  # pragma: no cover - libzmq contract
        raise TypeError(f"socket option {option} is not an integer")
    return value


TCP_RTO_MIN_US: Final = 45
"""Linux's per-socket least retransmission timeout, in microseconds
(include/uapi/linux/tcp.h, since 6.15); not in Python's socket module yet."""


def tune_rto_min(fd: int, rto_min_ms: float) -> bool:
    """Set the least retransmission timeout of the TCP socket libzmq opened
    as `fd` (from its monitor's CONNECTED event: the same process's fd, so
    a duplicate of it reaches the same socket). False where the kernel has
    no such option, or `fd` is no longer a TCP socket (it closed, and the
    number was reused, before the event was read)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) != socket.IPPROTO_TCP:
                return False
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, int(rto_min_ms * 1000))
    except OSError:
        return False
    return True


def _frame_bytes(frame: bytes | memoryview) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


class Plane:
    """One plane's sockets and the state its owner tasks share.

    Created only by :func:`open_plane`, which also runs the owner tasks; the
    plane is usable only inside that context. All methods are for the trio
    thread that opened it.
    """

    def __init__(
        self,
        *,
        name: str,
        inbound: zmq.Socket[bytes],
        outbound: zmq.Socket[bytes],
        monitor: zmq.Socket[bytes],
        inbound_monitor: zmq.Socket[bytes],
        address: str,
        max_message_bytes: int,
        drops: collections.Counter[str],
        config: PlaneConfig,
        keys: PlaneKeys,
        encrypted: bool,
        zap: tuple[ZapHandler, bytes] | None,
        chunked: bool = False,
    ) -> None:
        self.name: str = name
        self.keys: PlaneKeys = keys
        self.encrypted: bool = encrypted
        self.address: str = address
        self.max_message_bytes: int = max_message_bytes
        self.config: PlaneConfig = config
        # Metrics: messages and bytes (payload frames, no routing id) that
        # libzmq accepted for sending / that passed the inbound checks and
        # were queued for receive().
        self.sent_messages: int = 0
        self.sent_bytes: int = 0
        self.received_messages: int = 0
        self.received_bytes: int = 0
        self._drops = drops
        self._inbound = inbound
        self._outbound = outbound
        self._monitor = monitor
        self._inbound_monitor = inbound_monitor
        self.held = HeldGuard(
            name, HeldBytes(config.held_limit_bytes, config.held_total_bytes), self._drop
        )
        """What libzmq holds per connection that the plane never took."""
        self._peers: collections.OrderedDict[str, _Peer] = collections.OrderedDict()
        self._generation = 0
        self._outbox_send, self._outbox_receive = trio.open_memory_channel[
            tuple[str, bytes, tuple[bytes | memoryview, ...]]
        ](config.send_queue)
        self._inbox_send, self._inbox_receive = trio.open_memory_channel[Delivery](
            config.receive_queue
        )
        self._closed = False
        self._handler: Callable[[bytes, list[bytes]], None] | None = None
        self._own_addresses = {address}
        self._redirects: dict[str, str] = {}
        self.rto_tuned: collections.Counter[bool] = collections.Counter()
        """Connections whose retransmission floor was lowered (True) or
        could not be (False: an older kernel), `PlaneConfig.rto_min_ms`."""
        self._zap = zap
        self._gate: HandshakeGate | None = None
        self._verified: collections.OrderedDict[tuple[bytes, bytes], bytes] = (
            collections.OrderedDict()
        )
        self._sources: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        # A chunked plane's inbound checks (budgets, reassembly) and the ids
        # of the chunked messages it sends.
        budgets = chunks.ByteBudgets(config.peer_rate_bytes_per_s, config.peer_burst_bytes)
        self._intake = (
            chunks.Intake(self._drop, max_message=max_message_bytes, budgets=budgets)
            if chunked
            else None
        )
        self._message_ids = itertools.count(1)

    # --- public API -----------------------------------------------------------

    def send(self, addr: str, frames: Sequence[bytes | memoryview], *, peer: bytes) -> None:
        """Queue one message of one or more frames for node ``peer`` at ``addr``.

        ``peer`` is the node's id: its key, which the handshake must prove,
        follows from it. A send naming another id than the connection to
        ``addr`` was made for replaces that connection (``bad_peer_key``
        when the id cannot be a key).

        Never blocks and never raises for network reasons: a message that
        cannot be sent is dropped and counted under ``"<plane>.<reason>"``
        (``send_queue_full``, ``oversized``, ``peer_queue_full``,
        ``unreachable``, ``evicted``, ``bad_address``, ``bad_peer_key``,
        ``handshake_failed``, ``send_error``, ``closed``;
        ``receive_queue_full`` for a message to this plane itself; inbound
        adds ``oversized``, ``malformed``, ``unauthenticated``,
        ``handshake_refused``, ``newcomer_address_rate`` and
        ``newcomer_prefix_rate``, and on a chunked plane ``over_budget``,
        ``bulk_refused``, ``bulk_busy``, ``bulk_incomplete`` and
        ``bulk_malformed``). Raises only for programming errors (no
        frames, a frame that is not bytes-like, or on a chunked plane a
        message too big for one chunk with more than
        `mesh.chunks.MAX_FRAMES` frames).

        On a chunked plane a message bigger than
        `mesh.chunks.SINGLE_MESSAGE_BYTES` goes out as chunks; the receiver
        takes it only if its owner allows us (see :meth:`allow_bulk`).

        Frames are handed to libzmq without copying where they are large, so
        the caller must not modify a buffer after passing it here. A message
        to this plane itself (its address, or one given to
        :meth:`add_own_address`) is copied into its own receive queue and
        never touches a socket.
        """
        if not frames:
            raise ValueError("a message needs at least one frame")
        total = 0
        for frame in frames:
            if not isinstance(frame, bytes | memoryview):
                raise TypeError(f"frames must be bytes or memoryview, not {type(frame).__name__}")
            total += _frame_bytes(frame)
        if total > self.max_message_bytes:
            # The receiver's libzmq would drop the whole connection (and
            # everything queued on it) for a frame over its MAXMSGSIZE, and
            # its plane drops a message whose total is over the cap; refuse
            # here so one bad message costs only itself.
            self._drop("oversized")
            return
        chunked = self._intake is not None and total > chunks.SINGLE_MESSAGE_BYTES
        if chunked and len(frames) > chunks.MAX_FRAMES:
            raise ValueError(f"a chunked message has at most {chunks.MAX_FRAMES} frames")
        if self._closed:
            self._drop("closed")
            return
        if addr in self._own_addresses and peer == self.keys.node_id:
            self._deliver_locally(frames)
            return
        if self._outbox_send.statistics().current_buffer_used == 0:
            # Nothing queued ahead of us: hand it to libzmq now rather than
            # wake the owner task for it (a decode step's activations and
            # tokens are latency-bound). Safe: trio runs one task at a time
            # on this thread, and NOBLOCK sends never wait.
            self._transmit(addr, peer, tuple(frames))
            return
        try:
            self._outbox_send.send_nowait((addr, peer, tuple(frames)))
        except trio.WouldBlock:
            self._drop("send_queue_full")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._drop("closed")

    async def receive(self) -> Delivery:
        """The next inbound message: its authenticated peer and its frames
        (the routing-id frame removed).

        Messages from different senders interleave; frames are exactly what
        the sender sent and are *not* validated here (the wire layer does
        that). Raises ``trio.EndOfChannel`` once the plane has closed.
        """
        return await self._inbox_receive.receive()

    def source_of(self, peer: bytes) -> str | None:
        """The IP address the latest message from node ``peer`` came from
        (what libzmq's ``Peer-Address`` says of its connection); None for
        this node itself, or a peer not heard from lately. Delivered
        messages are handled in order, so inside a handler, or before the
        next ``receive()``, it is the address of the message at hand."""
        return self._sources.get(peer)

    def add_own_address(self, addr: str) -> None:
        """Another name of this plane (the address it advertises, when that
        differs from the bound one): messages to it never leave the process."""
        self._own_addresses.add(addr)

    def redirect(self, addr: str, via: str | None) -> None:
        """Send what is meant for ``addr`` to ``via`` from now on (a direct
        path to the node a relay reaches at ``addr``, spliced at ``via`` on
        this machine), or to ``addr`` again (``via`` None). The peer must
        still prove the same key at ``via``. The connection to a former
        ``via`` is closed; one to ``addr`` idles out (`idle_disconnect_s`)."""
        old = self._redirects.pop(addr, None)
        if via is not None:
            self._redirects[addr] = via
        peer = None if old is None or old == via else self._peers.get(old)
        if peer is not None:
            self._evict(peer, "unreachable")

    def talks_to(self, addr: str) -> bool:
        """Whether this plane holds a connection for ``addr`` (sent to it
        lately, itself or through a redirect)."""
        return self._redirects.get(addr, addr) in self._peers

    def deliver_to(self, handler: Callable[[bytes, list[bytes]], None] | None) -> None:
        """Hand each inbound message straight to ``handler`` from the plane's
        reader task, as ``handler(peer, frames)``, instead of queueing it for
        :meth:`receive` (None: queue again). Messages queued before the call
        stay queued, and messages the plane sends itself are always queued
        (see :meth:`send`).

        This saves a scheduler round per message, which matters to a
        latency-bound reader: the engine gets one message per hop per decode
        step. The handler runs in the reader's time, so it must not block,
        and it must not raise for bad input (the plane would close).
        """
        self._handler = handler

    def allow_bulk(self, allowance: Callable[[bytes], int] | None) -> None:
        """Who may send this (chunked) plane messages bigger than one chunk:
        ``allowance(peer)`` is the largest message node ``peer`` may send
        now, 0 for none (None: nobody, the default). It is asked at the
        first chunk of each such message and when a peer is over its byte
        budget, so it must be cheap and never raise. A node allows the
        peers its hop sessions take activations from."""
        if self._intake is not None:
            self._intake.allowance = allowance or chunks.no_bulk

    def admit(self, policy: Admit) -> None:
        """Who may complete a handshake with this plane from now on (an
        open swarm admits every key; see `mesh.zap`)."""
        if self._zap is not None:
            handler, domain = self._zap
            handler.set_policy(domain, policy)

    def limit_newcomers(self, gate: HandshakeGate | None) -> None:
        """Bound how fast keys new to this node may complete a handshake,
        per source address and prefix (`mesh.zap.HandshakeGate`; refusals
        counted as its reasons); None lifts the bound."""
        if self._zap is not None:
            handler, domain = self._zap
            handler.set_gate(domain, gate)
            self._gate = gate

    @property
    def peer_count(self) -> int:
        """Outbound connections currently held (bounded by ``max_peers``)."""
        return len(self._peers)

    @property
    def closed(self) -> bool:
        """True once the plane's sockets are closed."""
        return self._closed

    def __repr__(self) -> str:
        return f"<Plane {self.name} {self.address} peers={len(self._peers)}>"

    # --- shared helpers ---------------------------------------------------------

    def _drop(self, reason: str, count: int = 1) -> None:
        self._drops[f"{self.name}.{reason}"] += count

    async def _drain_forever(self, sock: zmq.Socket[bytes], deliver: _Deliver) -> None:
        """Own ``sock`` for reading: drain, re-check EVENTS, then wait on the FD.

        The FD only signals changes, so every message already queued must be
        read (until ``zmq.Again``) and ``EVENTS`` re-checked before sleeping;
        reading ``EVENTS`` also makes libzmq process its command queue, which
        is what re-arms the FD.
        """
        fd = _int_option(sock, zmq.FD)
        handled = 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if _int_option(sock, zmq.EVENTS) & zmq.POLLIN:
                    continue
                handled = 0
                await trio.lowlevel.wait_readable(fd)
                continue
            await deliver(frames)
            handled += 1
            if handled >= DRAIN_BATCH:
                handled = 0
                await trio.lowlevel.checkpoint()

    def _deliver_locally(self, frames: Sequence[bytes | memoryview]) -> None:
        """A message to ourselves (an entry that is also its chain's first or
        last hop) skips the sockets: a loopback round through libzmq's I/O
        thread costs four thread wake-ups per message. It is queued for
        receive(), never handled inside send(), so no caller re-enters its
        own handler; like the network, the receiver gets its own copy."""
        payload = [bytes(frame) for frame in frames]
        size = sum(len(frame) for frame in payload)
        try:
            self._inbox_send.send_nowait(Delivery(self.keys.node_id, payload))
        except trio.WouldBlock:
            self._drop("receive_queue_full")
            return
        self.sent_messages += 1
        self.sent_bytes += size
        self.received_messages += 1
        self.received_bytes += size

    # --- inbound ----------------------------------------------------------------

    async def _run_inbound(self) -> None:
        """Owner task of the inbound ROUTER."""
        await self._drain_forever(self._inbound, self._deliver_inbound)

    async def _deliver_inbound(self, frames: list[zmq.Frame]) -> None:
        """Strip the routing id, learn the authenticated peer, enforce the
        size cap on the whole message, on a chunked plane charge the peer's
        budget and reassemble (`mesh.chunks.Intake`), and hand it to
        receive(); waiting here when receive() lags is deliberate
        back-pressure (libzmq then stops reading, and senders' HWMs fill)."""
        if len(frames) < 2:  # a ROUTER always yields id + at least one frame
            self._drop("malformed")
            return
        size = sum(len(frame) for frame in frames[1:])
        try:
            self.held.took(frames[1].get(zmq.SRCFD), size, len(frames) - 1)
        except zmq.ZMQError:
            self.held.stand_down("libzmq has no SRCFD")
        peer = self._authenticated_peer(frames[1])
        if peer is None:
            self._drop("unauthenticated")
            return
        if size > self.max_message_bytes:
            # libzmq's MAXMSGSIZE is per frame; this catches many frames that
            # are each under the cap but together over it.
            self._drop("oversized")
            return
        self._note_source(peer, frames[1])
        if self._intake is None:
            payload = [frame.bytes for frame in frames[1:]]
        else:
            # Views, not copies: a chunk's piece stays in libzmq's buffer
            # until its message is whole (the one copy), or is dropped.
            views = [frame.buffer for frame in frames[1:]]
            taken = self._intake.take(peer, views, trio.current_time())
            if taken is None:
                return
            payload = taken
            size = sum(len(frame) for frame in payload)
        self.received_messages += 1
        self.received_bytes += size
        if self._handler is not None:
            self._handler(peer, payload)
        else:
            await self._inbox_send.send(Delivery(peer, payload))

    def _authenticated_peer(self, frame: zmq.Frame) -> bytes | None:
        """The id of the node that sent `frame`: the id it named in its
        handshake, once that id's key is the key the handshake proved (the
        ZAP handler's User-Id) and no other id proved that key first (the
        newcomer gate's `claim`). Unencrypted planes (benchmarks only) take
        the named id on trust."""
        try:
            named = frame.get(NODE_ID_PROPERTY)
            proved = frame.get("User-Id") if self.encrypted else ""
        except zmq.ZMQError:
            return None
        if not isinstance(named, str) or not isinstance(proved, str):
            return None
        cache_key = (named.encode(), proved.encode())
        node = self._verified.get(cache_key)
        if node is not None:
            return node
        try:
            node = bytes.fromhex(named)
        except ValueError:
            return None
        if len(node) != NODE_ID_BYTES:
            return None
        if self.encrypted:
            key = curve_public_key(node)
            if key is None or key.hex() != proved:
                return None
            if self._gate is not None and not self._gate.claim(key, node):
                return None  # its twin proved this key first: one key, one id
        self._verified[cache_key] = node
        if len(self._verified) > MAX_VERIFIED_PEERS:
            self._verified.popitem(last=False)
        return node

    def _note_source(self, peer: bytes, frame: zmq.Frame) -> None:
        """Remember where ``peer``'s message came from (see `source_of`).
        Read per message, since a peer may reconnect from elsewhere, but
        cheap: one property lookup (about 0.6 us, measured) and a dict
        write only when the address changed; bounded like the verified ids."""
        try:
            address = frame.get(PEER_ADDRESS_PROPERTY)
        except zmq.ZMQError:
            return
        if not isinstance(address, str) or self._sources.get(peer) == address:
            return
        self._sources[peer] = address
        self._sources.move_to_end(peer)
        if len(self._sources) > MAX_VERIFIED_PEERS:
            self._sources.popitem(last=False)

    # --- outbound ---------------------------------------------------------------

    async def _run_outbound(self) -> None:
        """Owner task of the outbound ROUTER: send what send() queued, and
        periodically sweep the peer table (unreachable, idle)."""
        sweep_every = min(
            MAX_SWEEP_INTERVAL_S,
            max(MIN_SWEEP_INTERVAL_S, self.config.unreachable_after_s / 4),
        )
        next_sweep = trio.current_time() + sweep_every
        while True:
            # Cancelling a memory-channel receive never loses an item, so the
            # timeout around it is safe.
            with trio.move_on_at(next_sweep):
                while True:
                    addr, peer, frames = await self._outbox_receive.receive()
                    self._transmit(addr, peer, frames)
            now = trio.current_time()
            self._sweep(now)
            if self._intake is not None:
                self._intake.reassembly.expire(now)
            if self._zap is not None:
                handler, domain = self._zap
                for reason, count in handler.take_refused(domain).items():
                    self._drop(reason, count)
            next_sweep = now + sweep_every

    def _transmit(self, addr: str, node: bytes, frames: tuple[bytes | memoryview, ...]) -> None:
        """Hand one message to libzmq: as is, or on a chunked plane as
        chunks when it is bigger than one. A chunk that cannot go out ends
        the message (counted once; the receiver gives up on the rest)."""
        addr = self._redirects.get(addr, addr)
        peer = self._peer_for(addr, node, trio.current_time())
        if peer is None:
            return
        size = sum(_frame_bytes(frame) for frame in frames)
        parts: Sequence[Sequence[bytes | memoryview]] = [frames]
        if self._intake is not None and size > chunks.SINGLE_MESSAGE_BYTES:
            parts = chunks.split(next(self._message_ids), frames)
        for part in parts:
            if not self._send_part(peer, part):
                return
        self.sent_messages += 1
        self.sent_bytes += size
        if not peer.up:
            peer.queued_while_down += 1

    def _send_part(self, peer: _Peer, frames: Sequence[bytes | memoryview]) -> bool:
        """One ZeroMQ message to ``peer``; False (counted) if it cannot go."""
        try:
            # copy=False: pyzmq copies small frames anyway and passes big ones
            # (activations) to libzmq by reference.
            self._outbound.send_multipart([peer.routing_id, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            # ROUTER_MANDATORY: this peer's pipe is at SNDHWM.
            self._drop("peer_queue_full")
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                # The pipe is gone (it should not be, with IMMEDIATE=0): start
                # over with a fresh connection on the next send.
                self._drop("unreachable")
                self._evict(peer, "unreachable")
            else:
                self._drop("send_error")
            return False
        return True

    def _peer_for(self, addr: str, node: bytes, now: float) -> _Peer | None:
        """The peer entry for ``addr``, connecting on first use (and again
        when the node at ``addr`` is another one: a restarted peer with a
        new identity, or two members claiming one address)."""
        peer = self._peers.get(addr)
        if peer is not None and peer.node != node:
            self._evict(peer, "unreachable")
            peer = None
        if peer is not None:
            self._peers.move_to_end(addr)
            peer.last_used = now
            return peer
        encoded = addr.encode("utf-8", errors="surrogateescape")
        if not encoded or len(encoded) > MAX_ADDRESS_BYTES:
            self._drop("bad_address")
            return None
        server_key = curve_public_key(node)
        if server_key is None:
            self._drop("bad_peer_key")
            return None
        while len(self._peers) >= self.config.max_peers:
            _, oldest = next(iter(self._peers.items()))
            self._evict(oldest, "evicted")
        self._generation += 1
        routing_id = encoded + b"#" + str(self._generation).encode()
        try:
            self._outbound.setsockopt(zmq.CONNECT_ROUTING_ID, routing_id)
            if self.encrypted:
                # Copied into this connection at connect(): each peer gets
                # its own server key, as each gets its own routing id.
                self._outbound.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            self._outbound.connect(addr)
        except (zmq.ZMQError, UnicodeError):
            # Malformed endpoint or unknown transport. Host names are resolved
            # later by libzmq's I/O thread, so this never blocks on DNS.
            self._drop("bad_address")
            return None
        peer = _Peer(address=addr, node=node, routing_id=routing_id, last_used=now)
        self._peers[addr] = peer
        return peer

    def _evict(self, peer: _Peer, reason: str) -> None:
        """Disconnect a peer and forget it; count what we know is lost.

        With LINGER=0 anything still in its pipe is discarded. If the peer
        was never reachable since we queued, all of that is lost and counted
        under ``reason``; if it was up, its pipe has normally drained (it is
        the least recently used or idle one) and nothing is counted.
        """
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        # ENOENT means libzmq no longer knows the endpoint: nothing to free.
        with suppress(zmq.ZMQError):
            self._outbound.disconnect(peer.address)
        if not peer.up and peer.queued_while_down:
            self._drop(reason, peer.queued_while_down)

    def _sweep(self, now: float) -> None:
        """Disconnect peers that have failed for too long or gone idle."""
        config = self.config
        for peer in list(self._peers.values()):
            down_since = None if peer.up else peer.down_since
            if down_since is not None and now - down_since >= config.unreachable_after_s:
                self._evict(peer, "unreachable")
            elif now - peer.last_used >= config.idle_disconnect_s:
                self._evict(peer, "unreachable" if not peer.up else "idle")

    # --- monitor ----------------------------------------------------------------

    async def _run_monitor(self) -> None:
        """Owner task of the outbound socket's monitor (a PAIR socket).

        It only updates the peer table (plain data; trio switches tasks only
        at awaits, so no update is ever seen half done); the outbound socket
        itself stays with its owner. Draining promptly matters: libzmq's I/O
        thread blocks if the monitor's queue (1,000 events) fills.
        """
        await self._drain_forever(self._monitor, self._on_monitor_message)

    async def _on_monitor_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2 or len(frames[0]) != _MONITOR_HEADER.size:
            return
        event, value = _MONITOR_HEADER.unpack(frames[0].bytes)
        # libzmq 4.3 reports the endpoint as given to connect() for these
        # events when it is a numeric address, which is what nodes advertise.
        # For host names some events carry the resolved form instead; those
        # peers simply never look "failing" and rely on the LRU and idle
        # limits instead.
        peer = self._peers.get(frames[1].bytes.decode("utf-8", errors="surrogateescape"))
        self._note_connection(event, value)
        if peer is None:
            return
        if event == zmq.EVENT_CONNECTED:
            peer.fd = value
            if self.config.rto_min_ms is not None:
                self.rto_tuned[tune_rto_min(value, self.config.rto_min_ms)] += 1
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            peer.up = True
            peer.down_since = None
            peer.queued_while_down = 0
        elif event == zmq.EVENT_DISCONNECTED:
            if peer.fd == value:
                peer.up = False
                peer.fd = None
        elif event & _HANDSHAKE_FAILED:
            # The peer refused us (a private swarm without our invitation, or
            # its newcomer bound) or is not the node we named (its key did
            # not match). libzmq does not retry a ZAP refusal (measured on
            # 4.3.5), so the sweep gives up on the peer like on any failing
            # one, and a later send connects afresh.
            self._drop("handshake_failed")
            if peer.down_since is None:
                peer.down_since = trio.current_time()
        elif event == zmq.EVENT_CONNECT_RETRIED and not peer.up and peer.down_since is None:
            peer.down_since = trio.current_time()

    async def _run_inbound_monitor(self) -> None:
        """Owner task of the inbound socket's monitor: tells the held-bytes
        guard of each connection that opens and closes."""
        await self._drain_forever(self._inbound_monitor, self._on_inbound_monitor_message)

    async def _on_inbound_monitor_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2 or len(frames[0]) != _MONITOR_HEADER.size:
            return
        self._note_connection(*_MONITOR_HEADER.unpack(frames[0].bytes))

    def _note_connection(self, event: int, fd: int) -> None:
        """Tell the held-bytes guard of a connection libzmq opened (either
        socket's monitor) or closed."""
        if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
            self.held.opened(fd)
        elif event == zmq.EVENT_DISCONNECTED:
            self.held.closed(fd)

    # --- teardown ---------------------------------------------------------------

    def _close(self) -> None:
        """Close channels and sockets; only after the owner tasks have ended."""
        if self._closed:
            return
        self._closed = True
        self._outbox_send.close()
        self._outbox_receive.close()
        self._inbox_send.close()
        monitors = (self._monitor, self._inbound_monitor)
        for sock in (self._inbound, self._outbound, *monitors):
            trio.lowlevel.notify_closing(_int_option(sock, zmq.FD))
        for monitored in (self._outbound, self._inbound):
            with suppress(zmq.ZMQError):
                monitored.disable_monitor()
        for sock in (*monitors, self._outbound, self._inbound):
            sock.close(linger=0)
        if self._zap is not None:
            handler, domain = self._zap
            handler.unregister(domain)


def _common_options(sock: zmq.Socket[bytes], config: PlaneConfig) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # never hang on close waiting for a peer
    sock.setsockopt(zmq.HEARTBEAT_IVL, config.heartbeat_ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, config.heartbeat_timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, config.heartbeat_ttl_ms)
    sock.setsockopt(zmq.HANDSHAKE_IVL, config.handshake_ivl_ms)


def _make_sockets(
    context: zmq.Context[zmq.Socket[bytes]],
    listen: str,
    max_frame_bytes: int,
    config: PlaneConfig,
    keys: PlaneKeys,
    zap_domain: bytes | None,
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Socket[bytes], zmq.Socket[bytes], str]:
    """Create, configure and bind; close everything again if any step fails.
    With a ZAP domain both sockets speak CURVE (inbound as the server whose
    handshakes that domain's policy admits); without one, plaintext."""
    made: list[zmq.Socket[bytes]] = []
    try:
        inbound = context.socket(zmq.ROUTER)
        made.append(inbound)
        _common_options(inbound, config)
        if zap_domain is not None:
            inbound.setsockopt(zmq.CURVE_SERVER, 1)
            inbound.setsockopt(zmq.CURVE_SECRETKEY, keys.curve_secret)
            inbound.setsockopt(zmq.ZAP_DOMAIN, zap_domain)
        # Per frame: libzmq drops the *connection* that sends a bigger frame
        # before allocating it (the sender reconnects; what it had queued is
        # lost), and other peers are unaffected.
        inbound.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        inbound.setsockopt(zmq.RCVHWM, config.receive_hwm or config.hwm)
        # IPv6 only when asked for: with IPV6=1 a v4 bind reports itself as
        # "tcp://[::ffff:127.0.0.1]:port", which is not what we advertise.
        inbound.setsockopt(zmq.IPV6, 1 if "[" in listen else 0)
        inbound.bind(listen)
        address = inbound.getsockopt_string(zmq.LAST_ENDPOINT)
        inbound_monitor = inbound.get_monitor_socket(_INBOUND_EVENTS)
        made.append(inbound_monitor)
        inbound_monitor.setsockopt(zmq.LINGER, 0)

        outbound = context.socket(zmq.ROUTER)
        made.append(outbound)
        _common_options(outbound, config)
        if zap_domain is not None:
            outbound.setsockopt(zmq.CURVE_PUBLICKEY, keys.curve_public)
            outbound.setsockopt(zmq.CURVE_SECRETKEY, keys.curve_secret)
        # Our id, sent in the handshake (encrypted under CURVE); the peer
        # checks that it maps to the key we proved (Plane._authenticated_peer).
        outbound.setsockopt(zmq.METADATA, f"{NODE_ID_PROPERTY}:{keys.node_id.hex()}".encode())
        outbound.setsockopt(zmq.IPV6, 1)  # reach tcp://[v6]:port peers as well as v4
        outbound.setsockopt(zmq.ROUTER_MANDATORY, 1)
        outbound.setsockopt(zmq.IMMEDIATE, 0)  # why: docs/design/transport.md
        outbound.setsockopt(zmq.SNDHWM, config.hwm)
        outbound.setsockopt(zmq.RCVHWM, OUTBOUND_RCVHWM)
        outbound.setsockopt(zmq.MAXMSGSIZE, OUTBOUND_MAX_FRAME_BYTES)
        outbound.setsockopt(zmq.CONNECT_TIMEOUT, config.connect_timeout_ms)
        outbound.setsockopt(zmq.RECONNECT_IVL, config.reconnect_ivl_ms)
        outbound.setsockopt(zmq.RECONNECT_IVL_MAX, config.reconnect_ivl_max_ms)
        monitor = outbound.get_monitor_socket(_MONITORED_EVENTS)
        made.append(monitor)
        monitor.setsockopt(zmq.LINGER, 0)
    except BaseException:
        for sock in reversed(made):
            sock.close(linger=0)
        raise
    return inbound, outbound, monitor, inbound_monitor, address


@asynccontextmanager
async def open_plane(
    listen: str,
    *,
    name: str,
    max_message_bytes: int,
    drops: collections.Counter[str],
    keys: PlaneKeys,
    encrypted: bool = True,
    admit: Admit = admit_every_key,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    config: PlaneConfig | None = None,
    chunked: bool = False,
    guarded: bool = True,
) -> AsyncIterator[Plane]:
    """Bind a plane on ``listen`` and run its owner tasks until the block exits.

    ``keys`` are the node's id and CurveZMQ key pair; ``admit`` decides
    which client keys may complete a handshake (see `mesh.zap`).
    ``encrypted=False`` is plaintext and takes each peer's id on trust: it
    exists only so benchmarks can measure what CURVE costs, and a plaintext
    plane cannot exchange a single message with an encrypted one.

    ``listen`` is a ZeroMQ endpoint such as ``"tcp://127.0.0.1:7001"``; port 0
    picks a free port and ``plane.address`` reports the real endpoint. Binding
    errors (address in use, bad endpoint) raise ``zmq.ZMQError`` here. Drops
    are counted in ``drops`` as ``"<name>.<reason>"``. ``context`` should be
    the process's shared one (``zmq.Context.instance()`` if omitted): one
    context means one set of I/O threads for every plane.

    The owner tasks live in a nursery inside this context manager; leaving
    the block cancels them, then closes both sockets with LINGER=0 (queued
    outbound messages are discarded, as a crash would).

    ``chunked`` makes it a data plane, with frames of one chunk at most and
    byte budgets (see :meth:`Plane.allow_bulk`, `mesh.chunks`).
    ``guarded=False`` leaves running the plane's held-bytes guard
    (`Plane.held`) to the caller, as `open_planes` runs both of its planes'
    in one task.
    """
    if max_message_bytes <= 0:
        raise ValueError("max_message_bytes must be positive")
    config = config or DEFAULT_CONTROL_CONFIG
    context = context or zmq.Context.instance()
    zap: tuple[ZapHandler, bytes] | None = None
    if encrypted:
        domain = f"shardmesh.{name}.{next(_zap_domains)}".encode()
        zap = (ZapHandler.register(context, domain, admit), domain)
    frame_limit = min(max_message_bytes, chunks.FRAME_LIMIT_BYTES if chunked else max_message_bytes)
    try:
        inbound, outbound, monitor, inbound_monitor, address = _make_sockets(
            context, listen, frame_limit, config, keys, zap[1] if zap else None
        )
    except BaseException:
        if zap is not None:
            zap[0].unregister(zap[1])
        raise
    plane = Plane(
        name=name,
        inbound=inbound,
        outbound=outbound,
        monitor=monitor,
        inbound_monitor=inbound_monitor,
        address=address,
        max_message_bytes=max_message_bytes,
        drops=drops,
        config=config,
        keys=keys,
        encrypted=encrypted,
        zap=zap,
        chunked=chunked,
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(plane._run_inbound, name=f"transport.{name}.inbound")
            nursery.start_soon(plane._run_outbound, name=f"transport.{name}.outbound")
            nursery.start_soon(plane._run_monitor, name=f"transport.{name}.monitor")
            nursery.start_soon(plane._run_inbound_monitor, name=f"transport.{name}.inbound_monitor")
            if guarded:
                nursery.start_soon(guard, plane.held, name=f"transport.{name}.held_guard")
            try:
                yield plane
            finally:
                nursery.cancel_scope.cancel()
    finally:
        plane._close()


@asynccontextmanager
async def open_planes(
    control_listen: str,
    data_listen: str,
    *,
    drops: collections.Counter[str],
    keys: PlaneKeys,
    encrypted: bool = True,
    admit: Admit = admit_every_key,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    control_config: PlaneConfig | None = None,
    data_config: PlaneConfig | None = None,
    control_max_message_bytes: int = CONTROL_MAX_MESSAGE_BYTES,
    data_max_message_bytes: int = DATA_MAX_MESSAGE_BYTES,
) -> AsyncIterator[tuple[Plane, Plane]]:
    """Open a node's two planes, ``(control, data)``, on one shared context.

    They are separate sockets (and TCP connections) so that a large
    activation on the data plane is never queued in front of a small,
    latency-sensitive probe or Raft message on the control plane.
    """
    async with (
        open_plane(
            control_listen,
            name="control",
            max_message_bytes=control_max_message_bytes,
            drops=drops,
            keys=keys,
            encrypted=encrypted,
            admit=admit,
            context=context,
            config=control_config or DEFAULT_CONTROL_CONFIG,
            guarded=False,
        ) as control,
        open_plane(
            data_listen,
            name="data",
            max_message_bytes=data_max_message_bytes,
            drops=drops,
            keys=keys,
            encrypted=encrypted,
            admit=admit,
            context=context,
            config=data_config or DEFAULT_DATA_CONFIG,
            chunked=True,
            guarded=False,
        ) as data,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(guard, control.held, data.held, name="transport.held_guard")
        try:
            yield control, data
        finally:
            nursery.cancel_scope.cancel()
