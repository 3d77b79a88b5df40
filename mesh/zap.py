"""ZAP: the one place a CURVE handshake asks "may this key connect?".

libzmq authenticates a CURVE client (it proves it holds the secret of the
public key it presents) and then asks the ZAP handler of its context,
over ``inproc://zeromq.zap.01``, whether that key may connect. Only the
handler's answer lets the connection through, and the ``User-Id`` it
returns rides on every message from that connection: that is how a plane
learns, per message, which key sent it (see `mesh.transport`).

There is one handler per ZeroMQ context (libzmq allows one bind of that
endpoint), shared by every plane on it; each plane registers its own ZAP
domain with an ``admit(client_key) -> bool`` policy: an open swarm admits
every key, a private one only keys with a valid invitation. The handler
runs in a thread, not a trio task, because libzmq's I/O thread waits for
its reply mid-handshake: a trio loop busy with a long step must not stall
every connection attempt. It reads the registry under a lock, counts the
keys it refused per domain (the plane moves them into its drop counters),
and stops when the last domain is unregistered, so `Context.term()` never
hangs on it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Final

import zmq

__all__ = ["Admit", "ZapHandler"]

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
        self._refused: Counter[bytes] = Counter()
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

    def unregister(self, domain: bytes) -> None:
        """Stop answering for `domain`; the last one out stops the thread."""
        with self._registry:
            with self._lock:
                self._domains.pop(domain, None)
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

    def take_refused(self, domain: bytes) -> int:
        """Handshakes refused for `domain` since the last call."""
        with self._lock:
            return self._refused.pop(domain, 0)

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
        version, request_id, domain, _address, _identity, mechanism = request[:6]
        credentials = request[6:]
        with self._lock:
            admit = self._domains.get(domain)
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        allowed = admit is not None and len(key) == 32 and _admits(admit, key)
        if not allowed:
            with self._lock:
                self._refused[domain] += 1
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
