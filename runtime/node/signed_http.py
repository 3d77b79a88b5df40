"""HTTP requests one node sends another, signed with the sender's identity.

A node's operator token is its own, so a node passing a call on to the Raft
leader (an admin call it checked itself, or a demand report) signs the
request with its Ed25519 identity, and the receiver checks who signed it and
whether that node may make this call. A signature is accepted only within
`MAX_SKEW_S` of the receiver's clock, and with a `ReplayGuard` only once. No
I/O: the clock comes in as `now`.

The signed bytes and the headers: docs/design/node.md#signed-node-to-node-http.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Final

from mesh.identity import NODE_ID_BYTES, SIGNATURE_BYTES, Signer, node_id_text, verify

SIGNED_BY: Final = "x-shardmesh-node"
SIGNED_AT: Final = "x-shardmesh-time"
SIGNATURE: Final = "x-shardmesh-signature"
SIGNED_HEADERS: Final = (SIGNED_BY, SIGNED_AT, SIGNATURE)
MAX_SKEW_S: Final = 60.0
"""How far a signature's timestamp may be from the receiver's clock, either way."""
REPLAY_MEMORY: Final = 65_536
"""Signatures a `ReplayGuard` remembers at most (the oldest go first)."""
_DOMAIN: Final = b"shardmesh-http-v1"


class SignatureRefused(Exception):
    """A signed request that does not verify; the message says why."""


class ReplayGuard:
    """The signatures a receiver has accepted while they could still verify
    (2 x `MAX_SKEW_S`), so each signed request is accepted once: a copy
    captured on the way is refused. A sender signs every attempt afresh."""

    def __init__(self, capacity: int = REPLAY_MEMORY) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # signature -> forget after
        self._capacity = capacity

    def first_use(self, signature: bytes, now: float) -> bool:
        """Record `signature`; False if it was already used."""
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if signature in self._seen:
            return False
        if len(self._seen) >= self._capacity:
            self._seen.popitem(last=False)
        self._seen[signature] = now + 2 * MAX_SKEW_S
        return True


def signing_input(method: str, path: str, body: bytes, at: str) -> bytes:
    """The bytes a node signs for one request (see the module doc)."""
    digest = hashlib.sha256(body).hexdigest()
    return b"\n".join(
        [_DOMAIN, method.upper().encode(), path.encode(), digest.encode(), at.encode()]
    )


def sign_request(signer: Signer, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
    """The headers that sign `method path` with `body`, made at `now`."""
    at = f"{now:.3f}"
    signature = signer.sign(signing_input(method, path, body, at))
    return {SIGNED_BY: node_id_text(signer.node_id), SIGNED_AT: at, SIGNATURE: signature.hex()}


def is_signed(headers: Mapping[str, str]) -> bool:
    """Whether the request claims to come from a node (any signing header)."""
    return any(name in headers for name in SIGNED_HEADERS)


def verify_request(
    headers: Mapping[str, str],
    method: str,
    path: str,
    body: bytes,
    now: float,
    replays: ReplayGuard | None = None,
) -> bytes:
    """The id of the node that signed this request; SignatureRefused when
    a header is missing or malformed, the timestamp is more than
    `MAX_SKEW_S` from `now`, the signature is not that node's, or
    `replays` has seen it before."""
    missing = [name for name in SIGNED_HEADERS if name not in headers]
    if missing:
        raise SignatureRefused(f"a signed request needs the headers {', '.join(missing)}")
    try:
        node = bytes.fromhex(headers[SIGNED_BY])
        signature = bytes.fromhex(headers[SIGNATURE])
        at = float(headers[SIGNED_AT])
    except ValueError:
        raise SignatureRefused("malformed signature headers") from None
    if len(node) != NODE_ID_BYTES or len(signature) != SIGNATURE_BYTES:
        raise SignatureRefused("malformed signature headers")
    if not math.isfinite(at) or abs(at - now) > MAX_SKEW_S:
        raise SignatureRefused(
            f"the signature's timestamp is more than {MAX_SKEW_S:.0f} s from this node's clock"
        )
    if not verify(node, signing_input(method, path, body, headers[SIGNED_AT]), signature):
        raise SignatureRefused(f"the signature is not node {node_id_text(node)[:12]}'s")
    if replays is not None and not replays.first_use(signature, now):
        raise SignatureRefused("this signed request was already used (a replay)")
    return node
