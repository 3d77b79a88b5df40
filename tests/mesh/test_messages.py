"""Membership messages (`mesh.messages`): the fixed signing layouts, who
must have signed each update, and the fingerprints delta sync compares."""

from __future__ import annotations

import pytest

from mesh.identity import Identity, verify
from mesh.messages import (
    FINGERPRINT_BITS,
    Alive,
    Dead,
    Record,
    Suspect,
    alive_signing_bytes,
    consensus_signing_bytes,
    dead_signing_bytes,
    record_signing_bytes,
    signer_of,
    signing_bytes,
    suspect_signing_bytes,
)

A = Identity.from_seed(b"a" * 32)
B = Identity.from_seed(b"b" * 32)
C = Identity.from_seed(b"c" * 32)


def test_signing_layouts_are_a_tag_then_fields_in_order_big_endian() -> None:
    node, other = A.node_id, B.node_id
    assert alive_signing_bytes(node, 258, "tcp://x") == (
        b"shardmesh/alive/1\x00" + node + b"\x00" * 6 + b"\x01\x02" + b"tcp://x"
    )
    assert suspect_signing_bytes(node, 1, other) == (
        b"shardmesh/suspect/1\x00" + node + (1).to_bytes(8, "big") + other
    )
    assert dead_signing_bytes(node, 1, other) == (
        b"shardmesh/dead/1\x00" + node + (1).to_bytes(8, "big") + other
    )
    assert record_signing_bytes(node, 7, b"{}") == (
        b"shardmesh/record/1\x00" + node + (7).to_bytes(8, "big") + b"{}"
    )
    assert consensus_signing_bytes(node, b"payload") == (
        b"shardmesh/consensus/1\x00" + node + b"payload"
    )
    # One kind's bytes never verify as another's: the tags differ.
    assert suspect_signing_bytes(node, 1, other) != dead_signing_bytes(node, 1, other)


def test_each_update_is_signed_by_its_subject_or_its_accuser() -> None:
    alive = Alive(A.node_id, 3, "tcp://a", A.sign(alive_signing_bytes(A.node_id, 3, "tcp://a")))
    suspect = Suspect(
        A.node_id, 3, B.node_id, B.sign(suspect_signing_bytes(A.node_id, 3, B.node_id))
    )
    dead = Dead(A.node_id, 3, C.node_id, C.sign(dead_signing_bytes(A.node_id, 3, C.node_id)))
    record = Record(A.node_id, 1, b"{}", A.sign(record_signing_bytes(A.node_id, 1, b"{}")))
    for update, signer in ((alive, A), (suspect, B), (dead, C), (record, A)):
        assert signer_of(update) == signer.node_id
        assert verify(signer_of(update), signing_bytes(update), update.signature)
        assert update.verified(verify)
    with pytest.raises(TypeError):
        signing_bytes("not an update")  # type: ignore[arg-type]


def test_a_bad_signature_is_not_verified_and_a_good_one_is_remembered() -> None:
    forged = Alive(A.node_id, 0, "tcp://a", B.sign(alive_signing_bytes(A.node_id, 0, "tcp://a")))
    assert not forged.verified(verify)
    calls: list[bytes] = []

    def counting(signer: bytes, data: bytes, signature: bytes) -> bool:
        calls.append(signer)
        return verify(signer, data, signature)

    good = Alive(A.node_id, 0, "tcp://a", A.sign(alive_signing_bytes(A.node_id, 0, "tcp://a")))
    assert good.verified(counting) and good.verified(counting)
    assert calls == [A.node_id]  # checked once for this verifier
    assert good.verified(verify)  # another verifier checks for itself


def test_fingerprints_name_the_claim_not_the_accuser() -> None:
    """Two members holding one suspicion from different accusers hold the
    same state; a death and a departure at one incarnation differ."""
    by_b = Suspect(A.node_id, 2, B.node_id, b"\x00" * 64)
    by_c = Suspect(A.node_id, 2, C.node_id, b"\x01" * 64)
    assert by_b.fingerprint() == by_c.fingerprint()
    assert by_b.fingerprint() != Suspect(A.node_id, 3, B.node_id, b"\x00" * 64).fingerprint()
    dead = Dead(A.node_id, 2, B.node_id, b"\x00" * 64)
    left = Dead(A.node_id, 2, A.node_id, b"\x00" * 64)
    assert len({by_b.fingerprint(), dead.fingerprint(), left.fingerprint()}) == 3
    assert dead.fingerprint() == Dead(A.node_id, 2, C.node_id, b"\x02" * 64).fingerprint()


def test_fingerprints_are_63_bit_and_ignore_the_signature() -> None:
    one = Alive(A.node_id, 0, "tcp://a", b"\x00" * 64)
    two = Alive(A.node_id, 0, "tcp://a", b"\x01" * 64)
    moved = Alive(A.node_id, 0, "tcp://elsewhere", b"\x00" * 64)
    assert one.fingerprint() == two.fingerprint() != moved.fingerprint()
    records = [Record(A.node_id, seq, b"{}", b"") for seq in range(50)]
    assert all(0 <= r.fingerprint() < 2**FINGERPRINT_BITS for r in records)
    assert len({r.fingerprint() for r in records}) == 50
    # Equality ignores the cached facts: a fingerprinted update equals a fresh one.
    assert one == Alive(A.node_id, 0, "tcp://a", b"\x00" * 64)
