"""Cheap deterministic signatures for simulated nodes.

A keyed BLAKE2b digest stands in for Ed25519, whose verification would
dominate a 1,000-node run's CPU. A node's signature still verifies only
under its own node id, and signatures and ids keep Ed25519's 64 and 32
bytes, so the membership core's signature and size checks stay exercised.
The per-node secret comes from the node id and a simulator-wide salt, so
the simulator (never the protocol code) could forge anything; real Ed25519
is covered by `mesh.identity`'s tests. The argument: docs/design/simulator.md.
"""

from __future__ import annotations

import hashlib

from simulations.seeds import derive_seed

NODE_ID_BYTES = 32
SIGNATURE_BYTES = 64
"""Same sizes as Ed25519 public keys and signatures (see ``mesh.identity``)."""

_SIM_SALT = b"shardmesh/sim/signing-salt/1"
"""Keys every node secret; known only to this module, never to a core."""

_ID_DOMAIN = b"shardmesh/sim/node-id/1\x00"

_secrets: dict[bytes, bytes] = {}
"""node_id -> secret cache: verification then costs one BLAKE2b, not two.

Only looked up by key, never iterated, so its order cannot leak anywhere.
"""


def _secret(node_id: bytes) -> bytes:
    secret = _secrets.get(node_id)
    if secret is None:
        secret = hashlib.blake2b(node_id, key=_SIM_SALT, digest_size=32).digest()
        _secrets[node_id] = secret
    return secret


def sim_node_id(seed: int, index: int) -> bytes:
    """The deterministic 32-byte id of simulated node ``index`` in run ``seed``."""
    material = _ID_DOMAIN + derive_seed(seed, "node-id", index).to_bytes(8, "big")
    return hashlib.blake2b(material, digest_size=NODE_ID_BYTES).digest()


class SimSigner:
    """A ``mesh.identity.Signer`` for one simulated node."""

    __slots__ = ("_secret", "node_id")

    def __init__(self, seed: int, index: int) -> None:
        self.node_id: bytes = sim_node_id(seed, index)
        self._secret = _secret(self.node_id)

    def sign(self, data: bytes) -> bytes:
        """A 64-byte keyed digest of ``data`` that only this node's key makes."""
        return hashlib.blake2b(data, key=self._secret, digest_size=SIGNATURE_BYTES).digest()


def sim_verify(node_id: bytes, data: bytes, signature: bytes) -> bool:
    """A ``mesh.identity.Verifier``: True only for ``node_id``'s own signature."""
    if len(node_id) != NODE_ID_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    expected = hashlib.blake2b(data, key=_secret(node_id), digest_size=SIGNATURE_BYTES).digest()
    return expected == signature
