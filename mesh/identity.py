"""Node identity: one Ed25519 key per node, kept in its state directory.

The node's id *is* its public key (32 bytes on the wire, lowercase hex in
text), so anything a node signs can be checked by anyone who knows its id,
with no key directory and no certificate authority. A record or accusation
that claims to come from node X verifies only under X's own key.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

NODE_ID_BYTES = 32
SIGNATURE_BYTES = 64
KEY_FILE = "node.key"

# Curve25519's field prime: Ed25519 keys map onto X25519 (CurveZMQ) keys
# through the birational map between the two curves, computed mod this.
_P: Final = 2**255 - 19


class IdentityError(Exception):
    """The key file is missing, unreadable, corrupt or too widely readable."""


def node_id_text(node_id: bytes) -> str:
    """The text form used in the API, logs and the CLI."""
    return node_id.hex()


def node_id_from_text(text: str) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise ValueError(f"node id {text!r} is not hex") from exc
    if len(raw) != NODE_ID_BYTES:
        raise ValueError(f"node id {text!r} is not {NODE_ID_BYTES} bytes")
    return raw


class Identity:
    """A private key and the node id derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.node_id: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """A deterministic identity (tests and simulations); seed is 32 bytes."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, state_dir: Path) -> Identity:
        """Load `state_dir/node.key`, creating it (mode 0600) on first start.

        A node restarted with the same state dir keeps its id, which is what
        lets it rejoin as itself with a higher incarnation.
        """
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / KEY_FILE
        if path.exists():
            mode = path.stat().st_mode & 0o777
            if mode & 0o077:
                raise IdentityError(
                    f"{path} has mode {mode:o}; an identity key must be private (chmod 600)"
                )
            raw = path.read_bytes()
            if len(raw) != 32:
                raise IdentityError(f"{path} is corrupt: expected 32 bytes, found {len(raw)}")
            return cls.from_seed(raw)
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fsync(handle.fileno())
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def plane_keys(self) -> PlaneKeys:
        """The CurveZMQ key pair of this identity: one key file, one id.

        The secret is the Ed25519 signing scalar (SHA-512 of the seed,
        clamped), as libsodium's `crypto_sign_ed25519_sk_to_curve25519`
        derives it, so its public half is `curve_public_key(node_id)`: a
        peer that knows our id knows our plane key, with no key exchange.
        """
        seed = self._key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        scalar = bytearray(hashlib.sha512(seed).digest()[:32])
        scalar[0] &= 248
        scalar[31] &= 127
        scalar[31] |= 64
        public = curve_public_key(self.node_id)
        if public is None:  # pragma: no cover - a generated key is always a point
            raise IdentityError("this identity has no Curve25519 form")
        return PlaneKeys(self.node_id, public, bytes(scalar))


@dataclass(frozen=True)
class PlaneKeys:
    """What a node's planes need: its id (sent to peers in the handshake's
    metadata) and its CurveZMQ key pair (raw 32-byte keys)."""

    node_id: bytes
    curve_public: bytes
    curve_secret: bytes = field(repr=False)


@functools.lru_cache(maxsize=4096)
def curve_public_key(node_id: bytes) -> bytes | None:
    """The X25519 public key of the Ed25519 key that is `node_id`, or None
    when `node_id` cannot be one (wrong length, or not a curve point's y).

    Montgomery u = (1 + y) / (1 - y) mod p, where y is the Edwards point's
    y coordinate (the id's low 255 bits). Two ids (a point and its negation,
    `curve_twin`) share one u; only the holder of the secret scalar can
    complete a handshake under it, so the id a peer claims is checked by
    mapping it here and comparing with the key the handshake proved (and
    that key bound to one of the two ids: `curve_twin`). Cached: a node
    maps the same few hundred peer ids over and over.
    """
    if len(node_id) != NODE_ID_BYTES:
        return None
    y = int.from_bytes(node_id, "little") & ((1 << 255) - 1)
    if y >= _P or y == 1:
        return None
    u = (1 + y) * pow(1 - y, _P - 2, _P) % _P
    return u.to_bytes(32, "little")


def curve_twin(node_id: bytes) -> bytes:
    """The other id with `node_id`'s CurveZMQ key: the same y, the other
    sign bit (`curve_public_key` maps both to one u).

    The map cannot be made one-to-one: the handshake proves only u, and
    whoever holds the secret scalar s of a point also holds -s, so it can
    sign as either id. No check tells the "real" one from its twin (half of
    all honest ids have the sign bit set), so the doors bind a key to the
    first id that proves it instead (`mesh.zap.HandshakeGate.claim`), and
    the ledger admits one id per key (`consensus.ledger`)."""
    return node_id[:-1] + bytes([node_id[-1] ^ 0x80]) if node_id else node_id


_FIELD_PRIME: Final = 2**255 - 19
_ORDER_8_Y: Final = int.from_bytes(
    bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"), "little"
)
SMALL_ORDER_Y: Final = frozenset({0, 1, _FIELD_PRIME - 1, _ORDER_8_Y, _FIELD_PRIME - _ORDER_8_Y})
"""The y coordinates of edwards25519's eight points of small order (orders
1, 2, 4 and 8; each y with both signs of x). A public key there is no one's
key: OpenSSL's Ed25519 verifies signatures against it that nobody made (the
all-zero key passes an all-zero signature for about one message in four),
so such a key signs nothing here, as libsodium refuses it too."""


def is_small_order(public_key: bytes) -> bool:
    """Whether a 32-byte Ed25519 public key encodes a small-order point
    (canonical or not: y is read modulo the field prime)."""
    y = int.from_bytes(public_key, "little") & ((1 << 255) - 1)
    return y % _FIELD_PRIME in SMALL_ORDER_Y


@functools.lru_cache(maxsize=4096)
def _public_key(node_id: bytes) -> Ed25519PublicKey | None:
    """The key that is `node_id`, parsed once (None: no one's key, small
    order). Cached, as `curve_public_key` is: a hop checks the receipt of
    the same previous hop on every decode step, an entry the last hop's."""
    if is_small_order(node_id):
        return None
    return Ed25519PublicKey.from_public_bytes(node_id)


def verify(node_id: bytes, data: bytes, signature: bytes) -> bool:
    """True when `signature` over `data` was made by the key that is `node_id`."""
    if len(node_id) != NODE_ID_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        key = _public_key(bytes(node_id))
        if key is None:
            return False
        key.verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class Signer(Protocol):
    """What a protocol core needs to sign: its id and a signing function.

    `Identity` is the real one; the simulator injects a cheap deterministic
    stand-in, as it injects the clock, so 1,000-node runs stay fast.
    """

    node_id: bytes

    def sign(self, data: bytes) -> bytes: ...


Verifier = Callable[[bytes, bytes, bytes], bool]
"""verify(node_id, data, signature) -> bool; `verify` above is the real one."""
