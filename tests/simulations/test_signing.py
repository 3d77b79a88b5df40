"""Simulated signatures: each node's signature verifies only under its own
id, with Ed25519's sizes, and ids are deterministic per run seed."""

from __future__ import annotations

from simulations.signing import (
    NODE_ID_BYTES,
    SIGNATURE_BYTES,
    SimSigner,
    sim_node_id,
    sim_verify,
)


def test_node_ids_are_32_bytes_deterministic_and_distinct() -> None:
    ids = {sim_node_id(seed, index) for seed in (1, 2) for index in range(100)}
    assert len(ids) == 200 and all(len(node_id) == NODE_ID_BYTES for node_id in ids)
    assert sim_node_id(1, 5) == sim_node_id(1, 5) == SimSigner(1, 5).node_id


def test_a_signature_verifies_under_its_own_node_and_nowhere_else() -> None:
    alice, bob = SimSigner(1, 0), SimSigner(1, 1)
    signature = alice.sign(b"suspect 7")
    assert len(signature) == SIGNATURE_BYTES
    assert sim_verify(alice.node_id, b"suspect 7", signature)
    assert not sim_verify(bob.node_id, b"suspect 7", signature)  # claims another accuser
    assert not sim_verify(alice.node_id, b"suspect 8", signature)  # tampered data
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    assert not sim_verify(alice.node_id, b"suspect 7", tampered)


def test_wrong_sizes_never_verify() -> None:
    alice = SimSigner(1, 0)
    signature = alice.sign(b"x")
    assert not sim_verify(alice.node_id[:31], b"x", signature)
    assert not sim_verify(alice.node_id, b"x", signature[:63])


def test_signing_is_deterministic() -> None:
    assert SimSigner(3, 9).sign(b"alive") == SimSigner(3, 9).sign(b"alive")
    assert SimSigner(3, 9).sign(b"alive") != SimSigner(4, 9).sign(b"alive")
