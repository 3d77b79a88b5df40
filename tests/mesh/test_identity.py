"""Node identity: the key file, its permissions, and what a signature proves."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest

from mesh.identity import (
    KEY_FILE,
    SMALL_ORDER_Y,
    Identity,
    IdentityError,
    curve_public_key,
    curve_twin,
    is_small_order,
    node_id_from_text,
    node_id_text,
    verify,
)


def test_a_new_key_is_private_and_the_id_survives_a_restart(tmp_path: Path) -> None:
    first = Identity.load_or_create(tmp_path / "state")
    key_file = tmp_path / "state" / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again = Identity.load_or_create(tmp_path / "state")
    assert again.node_id == first.node_id
    assert len(first.node_id) == 32
    assert Identity.load_or_create(tmp_path / "other").node_id != first.node_id


def test_a_world_readable_key_is_refused(tmp_path: Path) -> None:
    Identity.load_or_create(tmp_path)
    (tmp_path / KEY_FILE).chmod(0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(tmp_path)


def test_a_truncated_key_is_a_clear_error_naming_the_file(tmp_path: Path) -> None:
    key_file = tmp_path / KEY_FILE
    key_file.write_bytes(b"short")
    key_file.chmod(0o600)
    with pytest.raises(IdentityError, match=str(key_file)):
        Identity.load_or_create(tmp_path)


def test_signatures_verify_only_under_the_signers_id() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    signature = alice.sign(b"record")
    assert verify(alice.node_id, b"record", signature)
    assert not verify(bob.node_id, b"record", signature)
    assert not verify(alice.node_id, b"record!", signature)
    assert not verify(alice.node_id, b"record", signature[:-1] + bytes([signature[-1] ^ 1]))
    assert not verify(alice.node_id[:31], b"record", signature)
    # Each id's key is parsed once and kept: checks under it stay the same.
    assert verify(bytearray(alice.node_id), b"record", signature)
    assert not verify(alice.node_id, b"record", bob.sign(b"record"))


def test_node_id_text_round_trips_and_rejects_garbage() -> None:
    node_id = Identity.from_seed(b"s" * 32).node_id
    assert node_id_from_text(node_id_text(node_id)) == node_id
    with pytest.raises(ValueError, match="not hex"):
        node_id_from_text("zz")
    with pytest.raises(ValueError, match="32 bytes"):
        node_id_from_text("ab" * 31)


def test_an_id_and_its_sign_bit_twin_share_one_curve_key() -> None:
    node = Identity.generate().node_id
    twin = curve_twin(node)
    assert twin != node and curve_twin(twin) == node
    assert twin[:31] == node[:31] and (twin[31] ^ node[31]) == 0x80
    assert curve_public_key(twin) == curve_public_key(node) is not None


def test_a_small_order_key_signs_nothing() -> None:
    """OpenSSL verifies an all-zero signature under the all-zero key for
    about one message in four; no small-order point is anyone's key."""
    messages = [hashlib.sha256(b"nonce %d" % i).digest() for i in range(64)]
    for y in sorted(SMALL_ORDER_Y):
        for sign in (0, 0x80):
            key = bytearray(y.to_bytes(32, "little"))
            key[31] |= sign
            assert is_small_order(bytes(key))
            assert not any(verify(bytes(key), m, bytes(64)) for m in messages)
    honest = Identity.generate()
    assert not is_small_order(honest.node_id)
    assert verify(honest.node_id, b"data", honest.sign(b"data"))
