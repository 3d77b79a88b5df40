"""The DNS rebinding guard (`runtime.api.hosts`, checked by `runtime.api.auth.Gate`), in process.

The names a Host header may give are checked directly; then every call that
changes the swarm is sent to an `ApiNode` (tests/runtime/api/inprocess.py)
under a rebound name, with a credential that would otherwise pass, and must
be refused with 421 before anything changes, while the node's own names
(loopback, any IP address, its advertised host) keep working and reads stay
open to every name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh.identity import Identity
from runtime.api.hosts import host_name, host_refusal
from runtime.api.network import network_routes
from runtime.node.spot_check import EVIDENCE_PATH
from tests.runtime.api.inprocess import BEARER, JSON, ApiNode, client_of, error_of, leading_node

ADDRESSES = {
    "control": "tcp://10.0.0.5:7001",
    "data": "tcp://data.example:7002",
    "api": "http://Node.Example:7003",
}
POLICY = "/v1/network/policy"
CHANGE = {"cooldown_s": 30}
MEMBER_REPORTS = {"/v1/network/demand", EVIDENCE_PATH}


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost", "localhost"),
        ("LOCALHOST:8000", "localhost"),
        ("node.example.:80", "node.example"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("127.0.0.1:7003", "127.0.0.1"),
        ("::1", "::1"),  # unbracketed IPv6: no port to drop
        (" evil.example ", "evil.example"),
    ],
)
def test_a_host_header_is_read_as_its_name(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(
    "header",
    [
        None,  # HTTP/1.0 tools send none; browsers always do
        "127.0.0.1:7003",
        "10.1.2.3",
        "[::1]:7003",
        "[fe80::1]",
        "localhost:7003",
        "app.localhost",
        "node.example:7003",  # the advertised API host, any case, any port
        "NODE.EXAMPLE",
        "data.example",
    ],
)
def test_the_nodes_own_names_and_every_ip_address_are_served(header: str | None) -> None:
    assert host_refusal(header, ADDRESSES) is None


@pytest.mark.parametrize(
    "header",
    ["evil.example", "evil.example:7003", "node.example.evil.example", "localhost.evil.example",
     "evil.example@127.0.0.1", "127.0.0.1.evil.example", ""],
)  # fmt: skip
def test_any_other_name_is_refused_saying_which_are_served(header: str) -> None:
    refusal = host_refusal(header, ADDRESSES)
    assert refusal is not None
    assert repr(header) in refusal and "DNS rebinding" in refusal
    assert "data.example, node.example" in refusal and "10.0.0.5" not in refusal


@pytest.fixture
async def api_node(tmp_path: Path) -> AsyncIterator[ApiNode]:
    async with leading_node(tmp_path, fault_injection=True) as node:
        node.addresses = dict(ADDRESSES)
        yield node


def post_paths(node: ApiNode) -> list[str]:
    return [r.path for r in network_routes(node) if "POST" in (getattr(r, "methods", None) or ())]


async def test_a_rebound_name_changes_nothing_whatever_the_credential(api_node: ApiNode) -> None:
    """Issue 30: with a page's name pointed at the node, every POST was
    served; now each is a 421 before its credential or body is read."""
    member = Identity.generate()
    api_node.members.add(member.node_id)
    before = api_node.raft.ledger.to_json()
    body = json.dumps(CHANGE).encode()
    async with client_of(api_node) as client:
        for path in post_paths(api_node):
            headers = api_node.signed(path, body, member) if path in MEMBER_REPORTS else BEARER
            answer = await client.post(
                path, content=body, headers={**headers, "host": "evil.example"}
            )
            error = error_of(answer, 421, "misdirected_request")
            assert "'evil.example'" in error["message"], path
            assert error["type"] == "invalid_request_error"
        # Reads are public, under any name.
        read = await client.get("/v1/network/status", headers={"host": "evil.example"})
        assert read.status_code == 200
    assert api_node.raft.ledger.to_json() == before and not api_node.members.isolated


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1:7003", "[::1]:7003", "node.example"])
async def test_the_operator_calls_by_any_of_the_nodes_own_names(
    api_node: ApiNode, host: str
) -> None:
    async with client_of(api_node) as client:
        answer = await client.post(POLICY, json=CHANGE, headers={**BEARER, "host": host})
    assert answer.status_code == 200 and answer.json()["accepted"], answer.text


async def test_a_join_under_a_rebound_name_is_refused_before_its_body_is_read(
    api_node: ApiNode,
) -> None:
    async with client_of(api_node) as client:
        answer = await client.post(
            "/v1/network/join", content=b"{", headers={**JSON, "host": "evil.example"}
        )
        error_of(answer, 421, "misdirected_request")
        served = await client.post(
            "/v1/network/join", content=b"{", headers={**JSON, "host": "localhost"}
        )
        assert "malformed JSON" in error_of(served, 400)["message"]
