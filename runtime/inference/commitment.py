"""Per-hop commitments: what a hop signs about each step it computes.

Every hop, on every step, tells the entry what it computed: not the
activations but a sketch (a seeded random projection of each position's
input and output onto `SKETCH_DIMS` numbers), signed with its node key
together with the session, the step and what it served. A hop whose sketch
disagrees with an honest recomputation has signed evidence against itself
that a third party can check. A session's commitments form a hash chain, so
one signature (the first, every `SIGN_EVERY`-th, and the `seal`) covers
every commitment before it (`Commitment.verified_through`).

Why a random projection, what is sketched, the signed bytes:
docs/design/verified-compute.md#commitments.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import cbor2
import numpy as np

from mesh.identity import SIGNATURE_BYTES, Signer, verify

__all__ = [
    "CHAIN_DIGEST_BYTES",
    "COMMIT_DOMAIN",
    "DIGEST_BYTES",
    "SIGN_EVERY",
    "SKETCH_DIMS",
    "Commitment",
    "ids_digest",
    "sketch",
]

SKETCH_DIMS: Final = 8
"""Numbers per position. Noise of any direction moves every random
projection of a state by about its own relative size, so a handful of
dimensions detects it as surely as many; eight keep a step's commitment at
64 bytes per position (inputs and outputs) while making it unlikely that
honest rounding in one projection alone crosses the tolerance."""

COMMIT_DOMAIN: Final = b"shardmesh-commit-v1"
DIGEST_BYTES: Final = 16
"""blake2b digest of the first hop's token ids: exact, and 128 bits make a
collision (another token sequence with the same digest) out of reach."""

SIGN_EVERY: Final = 16
"""Commitments per signature. An Ed25519 signature costs 50-100 us of CPU,
a fifth to a half of a small model's decode step on a GPU; hashing the
chain costs a few microseconds. Signing one step in 16 (and the last, at
the close) leaves evidence for any step at most 15 links long (a few
hundred bytes of decode-step sketches) for a sixteenth of the cost."""

CHAIN_DIGEST_BYTES: Final = 32
"""sha256 of a commitment: what the next one names as ``previous``."""

_PROJECTIONS_CACHED: Final = 64
"""Projections kept ready (seed x width): one per open session of a hop,
rebuilt only when evicted. A 4,096-wide projection is 128 KiB."""


@functools.lru_cache(maxsize=_PROJECTIONS_CACHED)
def _projection(seed: int, width: int) -> np.ndarray:
    generator = np.random.default_rng([seed, width])
    matrix = generator.standard_normal((width, SKETCH_DIMS)) / np.sqrt(width)
    matrix = matrix.astype(np.float32)
    matrix.flags.writeable = False
    return matrix


def sketch(rows: np.ndarray, seed: int) -> np.ndarray:
    """``rows`` [T, W] projected onto the seed's ``SKETCH_DIMS`` directions:
    float32 [T, SKETCH_DIMS]. Deterministic for a seed and width, on any
    machine (numpy's PCG64 stream), so a recomputation elsewhere sketches
    with the same directions."""
    values = np.asarray(rows, dtype=np.float32)
    if values.ndim != 2:
        raise ValueError(f"sketch rows must be 2-D, got shape {values.shape}")
    return np.ascontiguousarray(values @ _projection(seed, values.shape[1]))


def ids_digest(ids: np.ndarray) -> bytes:
    """The exact commitment to token ids (the first hop's input)."""
    data = np.ascontiguousarray(ids, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


class _Encoded:
    """Where a `Commitment` keeps its signed bytes and their digest once
    encoded: slots of its own, not dataclass fields, so that neither
    construction, ``replace`` nor ``dataclasses.fields`` sees them (a copy
    with another field encodes its own)."""

    __slots__ = ("_digest", "_signed")


@dataclass(frozen=True, slots=True, eq=False)
class Commitment(_Encoded):
    """One hop's signed account of one step (see the module docstring).

    ``inputs`` is [count, SKETCH_DIMS], or [0, SKETCH_DIMS] on the first hop
    (which commits ``inputs_digest`` instead); ``outputs`` is [count,
    SKETCH_DIMS] on a hop that passes hidden states on, [1, SKETCH_DIMS]
    (the last position's logits) on the last hop, whose ``token`` is set.

    A value: its arrays are never modified once it is built, so the bytes
    it signs (and their digest) are encoded once, on first use, and kept.
    A hop needs them up to four times a step (its receipt, the next link's
    ``previous``, the next hop's check of the handoff and its relay to the
    entry), about 10 us each on a loaded machine: most of a decode step's
    commitment cost, on every hop.
    """

    hop: bytes
    entry: bytes
    session: str
    model: str
    layers: tuple[int, int]
    sketch_seed: int
    step: int
    pos: int
    count: int
    inputs_digest: bytes
    inputs: np.ndarray
    outputs: np.ndarray
    token: int | None
    previous: bytes = b""
    signature: bytes = b""

    def signed_bytes(self) -> bytes:
        """What the hop signs: everything but ``hop`` and the signature
        (encoded once, see the class docstring)."""
        encoded: bytes | None = getattr(self, "_signed", None)
        if encoded is None:
            encoded = self._encode_signed()
            object.__setattr__(self, "_signed", encoded)
        return encoded

    def _encode_signed(self) -> bytes:
        sketches = hashlib.sha256(
            np.ascontiguousarray(self.inputs, dtype="<f4").tobytes()
            + np.ascontiguousarray(self.outputs, dtype="<f4").tobytes()
        ).digest()
        value = [
            COMMIT_DOMAIN,
            self.entry,
            self.session,
            self.model,
            list(self.layers),
            self.sketch_seed,
            self.step,
            self.pos,
            self.count,
            self.inputs_digest,
            sketches,
            -1 if self.token is None else self.token,
            self.previous,
        ]
        return cbor2.dumps(value, canonical=True)

    def digest(self) -> bytes:
        """What the session's next commitment names as ``previous``."""
        digest: bytes | None = getattr(self, "_digest", None)
        if digest is None:
            digest = hashlib.sha256(self.signed_bytes()).digest()
            object.__setattr__(self, "_digest", digest)
        return digest

    def signed(self, signer: Signer) -> Commitment:
        signed_bytes = self.signed_bytes()
        signed = replace(self, signature=signer.sign(signed_bytes))
        # The signature is not part of what is signed: the copy's bytes
        # and digest are this one's.
        object.__setattr__(signed, "_signed", signed_bytes)
        object.__setattr__(signed, "_digest", self.digest())
        return signed

    def verified(self) -> bool:
        """True when ``hop`` signed exactly this commitment."""
        return len(self.signature) == SIGNATURE_BYTES and verify(
            self.hop, self.signed_bytes(), self.signature
        )

    def verified_through(self, links: Sequence[Commitment]) -> bool:
        """True when ``hop`` signed this commitment, itself or through
        ``links``: the session's commitments after it, each naming the one
        before as ``previous``, up to one it signed."""
        if self.verified():
            return True
        current: Commitment = self
        for link in links:
            if link.hop != self.hop or link.session != self.session:
                return False
            if link.previous != current.digest():
                return False
            if link.verified():
                return True
            current = link
        return False

    @property
    def position_range(self) -> range:
        return range(self.pos, self.pos + self.count)

    # --- transfer: a message to the entry, and evidence for the leader ---------

    def header_fields(self) -> dict[str, Any]:
        """What a ``commit`` (or ``token``) message carries in its header;
        the sketches travel as its payload (:meth:`payload`). The entry knows
        the rest from the session it opened."""
        return {
            "step": self.step,
            "pos": self.pos,
            "count": self.count,
            "in_rows": int(self.inputs.shape[0]),
            "in_digest": self.inputs_digest,
            "prev": self.previous,
            "sig": self.signature,
        }

    def payload(self) -> np.ndarray:
        return np.concatenate([self.inputs, self.outputs]).astype(np.float32, copy=False)

    def to_json(self) -> dict[str, Any]:
        """Every field, for evidence (hex for bytes, lists for sketches)."""
        return {
            "hop": self.hop.hex(),
            "entry": self.entry.hex(),
            "session": self.session,
            "model": self.model,
            "layers": list(self.layers),
            "sketch_seed": self.sketch_seed,
            "step": self.step,
            "pos": self.pos,
            "count": self.count,
            "inputs_digest": self.inputs_digest.hex(),
            "inputs": _encode_rows(self.inputs),
            "outputs": _encode_rows(self.outputs),
            "token": self.token,
            "previous": self.previous.hex(),
            "signature": self.signature.hex(),
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Commitment:
        """Rebuild evidence's commitment; ValueError for anything malformed
        (it came from another node)."""
        try:
            layers = value["layers"]
            token = value["token"]
            built = cls(
                hop=bytes.fromhex(value["hop"]),
                entry=bytes.fromhex(value["entry"]),
                session=str(value["session"]),
                model=str(value["model"]),
                layers=(int(layers[0]), int(layers[1])),
                sketch_seed=int(value["sketch_seed"]),
                step=int(value["step"]),
                pos=int(value["pos"]),
                count=int(value["count"]),
                inputs_digest=bytes.fromhex(value["inputs_digest"]),
                inputs=_decode_rows(value["inputs"]),
                outputs=_decode_rows(value["outputs"]),
                token=None if token is None else int(token),
                previous=bytes.fromhex(value["previous"]),
                signature=bytes.fromhex(value["signature"]),
            )
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"malformed commitment: {exc}") from None
        if built.count < 1 or built.inputs.shape[0] not in (0, built.count):
            raise ValueError("malformed commitment: rows do not match count")
        return built


def _encode_rows(rows: np.ndarray) -> str:
    """Sketch rows as base64 of their little-endian float32 bytes: exact,
    and a third of the size of decimal text."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<f4").tobytes()).decode()


def _decode_rows(value: object) -> np.ndarray:
    if not isinstance(value, str):
        raise ValueError("sketch rows must be base64 text")
    data = base64.b64decode(value, validate=True)
    if len(data) % (4 * SKETCH_DIMS):
        raise ValueError(f"sketch rows must be float32 [n, {SKETCH_DIMS}]")
    rows = np.frombuffer(data, dtype="<f4").reshape(-1, SKETCH_DIMS).astype(np.float32)
    if not np.isfinite(rows).all():
        raise ValueError("sketch rows must be finite")
    return rows
