"""Per-hop commitments: sketches, signatures, the hash chain, and evidence's JSON."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mesh.identity import Identity
from runtime.inference.commitment import (
    DIGEST_BYTES,
    SKETCH_DIMS,
    Commitment,
    ids_digest,
    sketch,
)

ENTRY = b"\x07" * 32


@pytest.fixture(scope="module")
def hop() -> Identity:
    return Identity.generate()


def commitment(hop: Identity, step: int = 0, previous: bytes = b"") -> Commitment:
    rows = np.random.default_rng(step).standard_normal((2, 64)).astype(np.float32)
    return Commitment(
        hop=hop.node_id,
        entry=ENTRY,
        session="ab" * 16,
        model="m",
        layers=(0, 4),
        sketch_seed=11,
        step=step,
        pos=step * 2,
        count=2,
        inputs_digest=b"",
        inputs=sketch(rows, 11),
        outputs=sketch(rows * 2, 11),
        token=None,
        previous=previous,
    )


def test_a_sketch_is_a_deterministic_projection_per_seed() -> None:
    rows = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
    one = sketch(rows, 5)
    assert one.shape == (3, SKETCH_DIMS) and one.dtype == np.float32
    assert np.array_equal(one, sketch(rows.copy(), 5)), "the same directions elsewhere"
    assert not np.allclose(one, sketch(rows, 6)), "another seed, other directions"
    assert np.allclose(sketch(rows * 2, 5), 2 * one, rtol=1e-5), "linear"
    with pytest.raises(ValueError, match="2-D"):
        sketch(rows[0], 5)


def test_ids_are_committed_exactly() -> None:
    ids = np.array([1, 2, 3], dtype=np.int64)
    assert len(ids_digest(ids)) == DIGEST_BYTES
    assert ids_digest(ids) == ids_digest(np.array([1, 2, 3], dtype=np.int32))
    assert ids_digest(ids) != ids_digest(np.array([1, 2, 4]))


def test_a_signed_commitment_verifies_and_a_changed_one_does_not(hop: Identity) -> None:
    signed = commitment(hop).signed(hop)
    assert signed.verified()
    assert not commitment(hop).verified(), "unsigned"
    assert not replace(signed, step=1).verified()
    assert not replace(signed, entry=b"\x08" * 32).verified(), "made for another entry"
    assert not replace(signed, outputs=signed.outputs + 1e-3).verified()
    assert not replace(signed, token=3).verified()


def test_one_signature_proves_the_links_before_it(hop: Identity) -> None:
    first = commitment(hop, 0)
    second = commitment(hop, 1, previous=first.digest())
    third = commitment(hop, 2, previous=second.digest()).signed(hop)
    assert first.verified_through([second, third])
    assert second.verified_through([third])
    assert not first.verified_through([second]), "no signed link"
    assert not first.verified_through([third]), "a link skipped"
    forged = replace(second, outputs=second.outputs + 1.0)
    assert not first.verified_through([forged, third]), "a changed link breaks the chain"
    other = Identity.generate()
    theirs = replace(third, hop=other.node_id).signed(other)
    assert not second.verified_through([theirs]), "another hop's signature proves nothing"


def test_evidence_json_round_trips_and_refuses_malformed(hop: Identity) -> None:
    signed = replace(commitment(hop), token=42).signed(hop)
    back = Commitment.from_json(signed.to_json())
    assert back.verified()
    assert back.signed_bytes() == signed.signed_bytes()
    assert back.token == 42 and back.layers == (0, 4)
    broken = {**signed.to_json(), "count": 0}
    with pytest.raises(ValueError, match="rows do not match count"):
        Commitment.from_json(broken)
    with pytest.raises(ValueError, match="malformed commitment"):
        Commitment.from_json({**signed.to_json(), "hop": "not hex"})
    missing = signed.to_json()
    del missing["signature"]
    with pytest.raises(ValueError, match="malformed commitment"):
        Commitment.from_json(missing)


def test_what_a_message_carries(hop: Identity) -> None:
    made = commitment(hop).signed(hop)
    fields = made.header_fields()
    assert fields["in_rows"] == 2 and fields["sig"] == made.signature
    payload = made.payload()
    assert payload.shape == (4, SKETCH_DIMS) and payload.dtype == np.float32
    assert list(made.position_range) == [0, 1]


def test_the_signed_bytes_are_encoded_once_and_never_stale(hop: Identity) -> None:
    one = commitment(hop)
    assert one.signed_bytes() is one.signed_bytes(), "kept, not encoded again"
    signed = one.signed(hop)
    assert signed.digest() == one.digest() and signed.verified()
    changed = replace(signed, step=1)
    assert changed.digest() != one.digest(), "a copy with another field encodes its own"
    assert not changed.verified()
    assert changed.digest() == replace(one, step=1).digest()
