"""ZAP: the one place a CURVE handshake asks "may this key connect?".

libzmq authenticates a CURVE client, then asks its context's ZAP handler
(over `inproc://zeromq.zap.01`) whether that key may connect; the `User-Id`
the handler returns rides on every message, which is how a plane learns
which key sent it. One handler thread per context (not a trio task: libzmq
waits for it mid-handshake) serves every plane's domain, each with its own
`admit(client_key)` policy and, optionally, a `HandshakeGate` that charges a
first-time key to its real source address and network prefix
(`mesh.newcomers`). Refusals are counted per domain and reason.

More: docs/design/transport.md#zap-who-may-connect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Final

import zmq

from mesh.newcomers import NewcomerLimit

__all__ = ["Admit", "HandshakeGate", "ZapHandler"]

log = logging.getLogger("shardmesh.zap")

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"

POLL_INTERVAL_MS: Final = 100
"""How often the handler thread looks up from its socket to check whether
it should stop. Longer delays unregistering the last plane (its close
waits for the thread); shorter wakes an idle node more often."""

Admit = Callable[[bytes], bool]
"""A domain's policy: given a client's raw 32-byte CURVE public key,
may it connect?"""

_STATUS_OK: Final = b"200"
_STATUS_DENIED: Final = b"400"

R_REFUSED: Final = "handshake_refused"
"""What a refusal by a domain's key policy is counted as."""

MAX_KNOWN_KEYS: Final = 65_536
"""Keys a gate remembers as already admitted, each with the id that proved
it (least recently seen go first): a swarm's members, who reconnect after
an idle disconnect or a restart of ours, must not be charged again each
time. 65,536 keys are a few MB, and a flood of new keys can only add them
at the bounded rate (so a key's binding to its id is forgotten only after
that many other keys got in)."""


class HandshakeGate:
    """The Sybil bound on one node's handshakes: a `NewcomerLimit` keyed by
    source address, for keys not known yet, and the one id each key may
    speak as (`claim`). Thread-safe: `admit` runs on the ZAP thread, `vouch`
    and `claim` on the node's trio thread, all under one lock. One gate
    serves both of a node's planes, so a newcomer is charged once and keeps
    one id on both."""

    def __init__(
        self, limit: NewcomerLimit, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limit = limit
        self._clock = clock
        self._lock = threading.Lock()
        # Admitted keys, least recently seen first, each with the id that
        # first proved it on a plane (None until one did).
        self._known: OrderedDict[bytes, bytes | None] = OrderedDict()

    def vouch(self, key: bytes) -> None:
        """`key` (a raw CURVE public key) belongs to a member that membership
        has learned: it is let in without being charged. A restarted node
        learns its whole swarm from its seed in one step; their reconnects
        must not wait for per-subnet budgets."""
        with self._lock:
            self._remember(key)

    def claim(self, key: bytes, node: bytes) -> bool:
        """May `node`, whose handshake proved `key`, speak as itself? The
        first id to prove a key keeps it: its sign-bit twin
        (`mesh.identity.curve_twin`), which the same secret can also sign
        as, is refused, so one key is one id on this node, charged once.
        Only a proved handshake binds (a vouch from gossip does not), so no
        one can bind an honest node's key to a made-up twin."""
        with self._lock:
            owner = self._known.get(key)
            if owner is not None and owner != node:
                return False
            self._remember(key, node)
            return True

    def admit(self, key: bytes, address: str) -> str | None:
        """Let `key`, connecting from `address` (a bare IP), through: None,
        or the reason it is refused for now."""
        with self._lock:
            if key in self._known:
                self._known.move_to_end(key)
                return None
            refused = self._limit.admit(address, self._clock())
            if refused is None:
                self._remember(key)
            return refused

    def _remember(self, key: bytes, node: bytes | None = None) -> None:
        self._known[key] = node or self._known.get(key)
        self._known.move_to_end(key)
        while len(self._known) > MAX_KNOWN_KEYS:
            self._known.popitem(last=False)


class ZapHandler:
    """The ZAP handler of one context; get it with :meth:`register`."""

    # Guards the registry, and is held through a handler's start and stop,
    # so a plane opening while the last one closes never finds the endpoint
    # still bound. The handler thread never takes it (only `_lock`).
    _registry = threading.Lock()
    _by_context: dict[int, ZapHandler] = {}

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._context = context
        self._lock = threading.Lock()
        self._domains: dict[bytes, Admit] = {}
        self._gates: dict[bytes, HandshakeGate] = {}
        self._refused: dict[bytes, Counter[str]] = {}
        self._stop = threading.Event()
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="shardmesh-zap", daemon=True)
        self._thread.start()

    @classmethod
    def register(
        cls, context: zmq.Context[zmq.Socket[bytes]], domain: bytes, admit: Admit
    ) -> ZapHandler:
        """Answer ZAP requests for `domain` with `admit`, starting the
        context's handler if it has none yet."""
        with cls._registry:
            handler = cls._by_context.get(id(context))
            if handler is None:
                handler = cls._by_context[id(context)] = ZapHandler(context)
            with handler._lock:
                if domain in handler._domains:
                    raise ValueError(f"ZAP domain {domain!r} is already registered")
                handler._domains[domain] = admit
            return handler

    def set_policy(self, domain: bytes, admit: Admit) -> None:
        """Change who `domain` admits (a swarm turning private); from the
        next handshake on."""
        with self._lock:
            if domain in self._domains:
                self._domains[domain] = admit

    def set_gate(self, domain: bytes, gate: HandshakeGate | None) -> None:
        """Bound how fast new keys may connect to `domain` (None: unbounded)."""
        with self._lock:
            if domain not in self._domains:
                return
            if gate is None:
                self._gates.pop(domain, None)
            else:
                self._gates[domain] = gate

    def unregister(self, domain: bytes) -> None:
        """Stop answering for `domain`; the last one out stops the thread."""
        with self._registry:
            with self._lock:
                self._domains.pop(domain, None)
                self._gates.pop(domain, None)
                self._refused.pop(domain, None)
                if self._domains:
                    return
            del self._by_context[id(self._context)]
            self._shut_down()

    def _shut_down(self) -> None:
        self._stop.set()
        self._thread.join()
        # Unbind first: libzmq frees a closed socket's inproc endpoint later,
        # on its reaper thread, and planes opened right after (a restart in
        # the same process) would find the ZAP endpoint still taken.
        self._socket.unbind(ZAP_ENDPOINT)
        self._socket.close(linger=0)

    def take_refused(self, domain: bytes) -> Counter[str]:
        """Handshakes refused for `domain` since the last call, by reason:
        `R_REFUSED` for the key policy, a `mesh.newcomers` reason for the
        gate."""
        with self._lock:
            return self._refused.pop(domain, None) or Counter()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_INTERVAL_MS):
                continue
            request = self._socket.recv_multipart()
            self._socket.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """RFC 27: version, request id, domain, address, identity,
        mechanism, credentials... -> version, request id, status code,
        status text, user id, metadata."""
        if len(request) < 6:
            return [b"1.0", b"", _STATUS_DENIED, b"malformed request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        with self._lock:
            admit = self._domains.get(domain)
            gate = self._gates.get(domain)
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        allowed = admit is not None and len(key) == 32 and _admits(admit, key)
        refused = None if allowed else R_REFUSED
        if refused is None and gate is not None:
            refused = gate.admit(key, address.decode(errors="replace"))
        if refused is not None:
            with self._lock:
                self._refused.setdefault(domain, Counter())[refused] += 1
            return [version, request_id, _STATUS_DENIED, b"not admitted", b"", b""]
        # The user id is the key in hex: the plane compares it with the
        # key of the node id the peer claims in its handshake metadata.
        return [version, request_id, _STATUS_OK, b"OK", key.hex().encode(), b""]


def _admits(admit: Admit, key: bytes) -> bool:
    """`admit(key)`, with a policy that raises taken as a refusal: the
    handler thread must outlive a bug in one plane's policy."""
    try:
        return admit(key)
    except Exception:
        log.exception("a ZAP policy failed; refusing the handshake")
        return False
