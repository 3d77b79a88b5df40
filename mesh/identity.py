"""Node identity: one Ed25519 key per node, kept in its state directory.

The node's id *is* its public key (32 bytes on the wire, lowercase hex in
text), so anything a node signs can be checked by anyone who knows its id,
with no key directory and no certificate authority. A record or accusation
that claims to come from node X verifies only under X's own key.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

NODE_ID_BYTES = 32
SIGNATURE_BYTES = 64
KEY_FILE = "node.key"


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


def verify(node_id: bytes, data: bytes, signature: bytes) -> bool:
    """True when `signature` over `data` was made by the key that is `node_id`."""
    if len(node_id) != NODE_ID_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(node_id).verify(signature, data)
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
