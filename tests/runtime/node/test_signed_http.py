"""Signed node-to-node requests: who signed, within the skew, once."""

from __future__ import annotations

import pytest

from mesh.identity import Identity
from runtime.node.signed_http import (
    MAX_SKEW_S,
    SIGNATURE,
    SIGNED_AT,
    SIGNED_BY,
    ReplayGuard,
    SignatureRefused,
    is_signed,
    sign_request,
    verify_request,
)

NOW = 1_700_000_000.0
BODY = b'{"model": "m", "count": 3}'


@pytest.fixture(scope="module")
def node() -> Identity:
    return Identity.generate()


def test_a_signed_request_verifies_as_its_signer(node: Identity) -> None:
    headers = sign_request(node, "post", "/v1/network/demand", BODY, NOW)
    assert is_signed(headers)
    assert set(headers) == {SIGNED_BY, SIGNED_AT, SIGNATURE}
    assert verify_request(headers, "POST", "/v1/network/demand", BODY, NOW + 1) == node.node_id


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/network/demand", BODY),
        ("POST", "/v1/network/evidence", BODY),
        ("POST", "/v1/network/demand", BODY + b" "),
    ],
)
def test_the_signature_covers_method_path_and_body(
    node: Identity, method: str, path: str, body: bytes
) -> None:
    headers = sign_request(node, "POST", "/v1/network/demand", BODY, NOW)
    with pytest.raises(SignatureRefused, match="is not node"):
        verify_request(headers, method, path, body, NOW)


def test_a_timestamp_outside_the_skew_is_refused(node: Identity) -> None:
    headers = sign_request(node, "POST", "/p", BODY, NOW)
    verify_request(headers, "POST", "/p", BODY, NOW + MAX_SKEW_S)
    with pytest.raises(SignatureRefused, match="timestamp"):
        verify_request(headers, "POST", "/p", BODY, NOW + MAX_SKEW_S + 1)
    with pytest.raises(SignatureRefused, match="timestamp"):
        verify_request(headers, "POST", "/p", BODY, NOW - MAX_SKEW_S - 1)


def test_another_nodes_id_on_the_signature_is_refused(node: Identity) -> None:
    other = Identity.generate()
    headers = {**sign_request(node, "POST", "/p", BODY, NOW), SIGNED_BY: other.node_id.hex()}
    with pytest.raises(SignatureRefused, match="is not node"):
        verify_request(headers, "POST", "/p", BODY, NOW)


@pytest.mark.parametrize(
    "broken",
    [
        {SIGNED_BY: "zz"},
        {SIGNATURE: "ab" * 10},
        {SIGNED_AT: "soon"},
        {SIGNED_AT: "nan"},
    ],
)
def test_malformed_headers_are_refused(node: Identity, broken: dict[str, str]) -> None:
    headers = {**sign_request(node, "POST", "/p", BODY, NOW), **broken}
    with pytest.raises(SignatureRefused):
        verify_request(headers, "POST", "/p", BODY, NOW)


def test_a_missing_header_is_named(node: Identity) -> None:
    headers = sign_request(node, "POST", "/p", BODY, NOW)
    del headers[SIGNATURE]
    assert is_signed(headers)
    with pytest.raises(SignatureRefused, match=SIGNATURE):
        verify_request(headers, "POST", "/p", BODY, NOW)
    assert not is_signed({"content-type": "application/json"})


def test_a_replay_guard_accepts_each_signature_once(node: Identity) -> None:
    guard = ReplayGuard()
    headers = sign_request(node, "POST", "/p", BODY, NOW)
    verify_request(headers, "POST", "/p", BODY, NOW, guard)
    with pytest.raises(SignatureRefused, match="replay"):
        verify_request(headers, "POST", "/p", BODY, NOW + 1, guard)
    fresh = sign_request(node, "POST", "/p", BODY, NOW + 1)  # signed afresh: accepted
    verify_request(fresh, "POST", "/p", BODY, NOW + 1, guard)


def test_the_replay_guard_forgets_what_could_no_longer_verify() -> None:
    guard = ReplayGuard(capacity=2)
    assert guard.first_use(b"a", NOW)
    assert not guard.first_use(b"a", NOW + 2 * MAX_SKEW_S)
    assert guard.first_use(b"a", NOW + 2 * MAX_SKEW_S + 1), "expired: forgotten"
    assert guard.first_use(b"b", NOW + 2 * MAX_SKEW_S + 1)
    assert guard.first_use(b"c", NOW + 2 * MAX_SKEW_S + 1), "over capacity: the oldest goes"
    assert guard.first_use(b"a", NOW + 2 * MAX_SKEW_S + 1)
