"""Who may change the swarm over HTTP (issue 13, item 4).

Chat and reads are public; every call that changes the swarm needs the
node's operator token (`STATE_DIR/operator.token`) or, passed on between
nodes, a node's signature that the receiver checks against who may make the
call. Every POST is JSON only, and no CORS header is ever sent. The signing
and token files are tested directly; every route's gate in process
(`runtime.api.auth.Gate`, tests/runtime/api/inprocess.py); the rest against
real node processes.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mesh.identity import Identity, node_id_text
from mesh.member_table import MemberState
from runtime.api.auth import Gate
from runtime.api.network import network_routes
from runtime.cli import operator_token as token_module
from runtime.cli.localswarm import LocalNode, LocalSwarm
from runtime.cli.operator_token import TOKEN_ENV, TokenError, find_token
from runtime.model.tiny import make_tiny_model
from runtime.node.direct_paths import PUNCH_PATH
from runtime.node.signed_http import (
    MAX_SKEW_S,
    SIGNATURE,
    SIGNED_AT,
    SIGNED_BY,
    ReplayGuard,
    SignatureRefused,
    sign_request,
    verify_request,
)
from runtime.node.spot_check import EVIDENCE_PATH
from runtime.node.state_dir import (
    OPERATOR_TOKEN_FILE,
    StateDir,
    StateDirError,
    load_or_create_operator_token,
    read_operator_token,
)
from tests.runtime.api.inprocess import (
    BEARER,
    JSON,
    TOKEN,
    ApiNode,
    client_of,
    error_of,
    leading_node,
)
from tests.runtime.cli.test_main import CLI_TIMEOUT_S, shardmesh_command
from tests.swarm_helpers import START_TIMEOUT_S, wait_for

POLICY = "/v1/network/policy"
DEMAND = "/v1/network/demand"
NODES_ASSIGN = "/v1/nodes/assign"
CHANGE = {"idle_release_s": 600}
NOW = 1_700_000_000.0

# --- signed requests between nodes ------------------------------------------------


def test_a_signed_request_verifies_only_unchanged_and_on_time() -> None:
    signer = Identity.from_seed(bytes(range(32)))
    body = b'{"model": "m"}'
    headers = sign_request(signer, "POST", DEMAND, body, NOW)
    assert headers[SIGNED_BY] == node_id_text(signer.node_id)
    assert verify_request(headers, "POST", DEMAND, body, NOW) == signer.node_id
    # Within the skew either way; a minute and a bit off is refused.
    assert verify_request(headers, "POST", DEMAND, body, NOW + MAX_SKEW_S - 1) == signer.node_id
    assert verify_request(headers, "POST", DEMAND, body, NOW - MAX_SKEW_S + 1) == signer.node_id
    for now in (NOW + MAX_SKEW_S + 1, NOW - MAX_SKEW_S - 1):
        with pytest.raises(SignatureRefused, match="timestamp"):
            verify_request(headers, "POST", DEMAND, body, now)
    # Each signed part matters: body, path, method, time, signer.
    for method, path, sent in [
        ("POST", DEMAND, b'{"model": "n"}'),
        ("POST", POLICY, body),
        ("PUT", DEMAND, body),
    ]:
        with pytest.raises(SignatureRefused, match="not node"):
            verify_request(headers, method, path, sent, NOW)
    with pytest.raises(SignatureRefused, match="not node"):
        verify_request({**headers, SIGNED_AT: f"{NOW + 1:.3f}"}, "POST", DEMAND, body, NOW)
    other = Identity.from_seed(bytes(32))
    with pytest.raises(SignatureRefused, match="not node"):
        verify_request(
            {**headers, SIGNED_BY: node_id_text(other.node_id)}, "POST", DEMAND, body, NOW
        )
    # Missing or malformed headers.
    with pytest.raises(SignatureRefused, match="needs the headers"):
        verify_request({SIGNED_BY: headers[SIGNED_BY]}, "POST", DEMAND, body, NOW)
    for name, value in [(SIGNATURE, "zz"), (SIGNED_BY, "ab"), (SIGNED_AT, "soon")]:
        with pytest.raises(SignatureRefused, match="malformed"):
            verify_request({**headers, name: value}, "POST", DEMAND, body, NOW)
    with pytest.raises(SignatureRefused, match="timestamp"):
        verify_request({**headers, SIGNED_AT: "nan"}, "POST", DEMAND, body, NOW)


def test_a_signed_request_is_accepted_once() -> None:
    signer = Identity.from_seed(bytes(range(32)))
    body = b"{}"
    guard = ReplayGuard(capacity=3)
    first = sign_request(signer, "POST", POLICY, body, NOW)
    assert verify_request(first, "POST", POLICY, body, NOW, guard) == signer.node_id
    with pytest.raises(SignatureRefused, match="already used"):
        verify_request(first, "POST", POLICY, body, NOW + 1, guard)
    again = sign_request(signer, "POST", POLICY, body, NOW + 0.5)  # signed afresh: fine
    assert verify_request(again, "POST", POLICY, body, NOW + 1, guard) == signer.node_id
    # Forgotten only once it could no longer verify anyway, or when full.
    assert not guard.first_use(bytes.fromhex(first[SIGNATURE]), NOW + 2 * MAX_SKEW_S - 1)
    assert guard.first_use(bytes.fromhex(first[SIGNATURE]), NOW + 2 * MAX_SKEW_S + 1)
    for n in range(3):
        assert guard.first_use(bytes([n]), NOW + 200)
    assert guard.first_use(bytes.fromhex(first[SIGNATURE]), NOW + 200)  # evicted


# --- in process: every route's gate ---------------------------------------------------

MEMBER_REPORTS = (DEMAND, EVIDENCE_PATH, PUNCH_PATH)
"""Taken only signed by a live member: never the operator's to invent."""
OPERATOR_ONLY = ("/v1/network/refound", "/v1/network/invitations", "/v1/debug/faults")
"""This node's operator's calls only: no other node may ask them for it."""


@pytest.fixture
async def api_node(tmp_path: Path) -> AsyncIterator[ApiNode]:
    async with leading_node(tmp_path, fault_injection=True) as node:
        yield node


def post_paths(node: ApiNode) -> list[str]:
    """Every POST route of the network API but a join (signed by the newcomer's key)."""
    paths = [r.path for r in network_routes(node) if "POST" in (getattr(r, "methods", None) or ())]
    return [path for path in paths if path != "/v1/network/join"]


async def test_every_call_that_changes_the_swarm_needs_a_credential(api_node: ApiNode) -> None:
    paths = post_paths(api_node)
    assert {POLICY, DEMAND, NODES_ASSIGN, *OPERATOR_ONLY} <= set(paths)
    before = api_node.raft.ledger.to_json()
    async with client_of(api_node) as client:
        for path in paths:
            for headers in [
                {},
                {"authorization": "Bearer nope"},
                {"authorization": f"Basic {TOKEN}"},
                {"authorization": TOKEN},
            ]:
                answer = await client.post(path, content=b"{}", headers={**JSON, **headers})
                if path in MEMBER_REPORTS:
                    assert "signed by a member" in error_of(answer, 403, "forbidden")["message"]
                    continue
                error = error_of(answer, 401, "unauthorized")
                assert answer.headers["www-authenticate"] == "Bearer"
                assert "operator token" in error["message"] and "STATE_DIR" in error["message"]
                assert error["type"] == "authentication_error"
        # The operator's own token is no credential for a member's report.
        for path in MEMBER_REPORTS:
            refused = await client.post(path, content=b"{}", headers=BEARER)
            error_of(refused, 403, "forbidden")
    assert api_node.raft.ledger.to_json() == before
    assert not api_node.members.isolated


async def test_the_token_is_the_nodes_own_and_compared_whole(api_node: ApiNode) -> None:
    async with client_of(api_node) as client:
        for given in (TOKEN[:-1], TOKEN + "x", TOKEN.upper(), ""):
            refused = await client.post(
                POLICY, json=CHANGE, headers={"authorization": f"Bearer {given}"}
            )
            error_of(refused, 401, "unauthorized")
        # The scheme's case and the spaces around the token do not matter.
        accepted = await client.post(
            POLICY, json=CHANGE, headers={"authorization": f"bearer  {TOKEN} "}
        )
        assert accepted.status_code == 200 and accepted.json()["accepted"], accepted.text


async def test_a_web_page_cannot_make_a_call_for_the_operator(api_node: ApiNode) -> None:
    """Cross-site requests: a page can send a form or text/plain without
    a preflight, never JSON, so anything but JSON is a 415; and no answer
    carries a CORS header, so no other site's script may read one."""
    body = json.dumps(CHANGE).encode()
    bearer = {"authorization": f"Bearer {TOKEN}"}
    origin = {"origin": "https://evil.example"}
    async with client_of(api_node) as client:
        for declared in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            plain = await client.post(
                POLICY, content=body, headers={**bearer, "content-type": declared}
            )
            assert declared in error_of(plain, 415, "unsupported_media_type")["message"]
        form = await client.post(POLICY, data=CHANGE, headers=bearer)
        error_of(form, 415, "unsupported_media_type")
        error_of(await client.post(POLICY, content=body, headers=bearer), 415)  # none declared
        assert (await client.get(POLICY)).json()["settings"] == {}
        preflight = await client.options(
            POLICY,
            headers={
                **origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )
        error_of(preflight, 405, "method_not_allowed")
        posted = await client.post(POLICY, content=body, headers={**origin, **JSON, **bearer})
        assert posted.status_code == 200
        for response in (preflight, posted, await client.get(POLICY, headers=origin)):
            assert not [h for h in response.headers if h.lower().startswith("access-control-")]


async def test_a_node_signed_call_is_checked_against_who_signed(api_node: ApiNode) -> None:
    stranger = Identity.generate()
    body = json.dumps({"cooldown_s": 30}).encode()
    async with client_of(api_node) as client:
        # Signed by this node, a voter (as a forward from a voter would be): accepted once.
        headers = api_node.signed(POLICY, body)
        by_voter = await client.post(POLICY, content=body, headers=headers)
        assert by_voter.status_code == 200 and by_voter.json()["accepted"], by_voter.text
        replay = await client.post(POLICY, content=body, headers=headers)
        assert "already used" in error_of(replay, 403, "forbidden")["message"]
        # A non-voter's: 403 naming who signed.
        other = json.dumps(CHANGE).encode()
        refused = await client.post(
            POLICY, content=other, headers=api_node.signed(POLICY, other, stranger)
        )
        error = error_of(refused, 403, "forbidden")
        assert "only a Raft voter's" in error["message"]
        assert node_id_text(stranger.node_id)[:12] in error["message"]
        # A voter's signature that is stale, over another body, or for another path: 403.
        for when, over, path in [
            (time.time() - 2 * MAX_SKEW_S, other, POLICY),
            (time.time(), b'{"cooldown_s": 1}', POLICY),
            (time.time(), other, DEMAND),
        ]:
            headers = {**JSON, **sign_request(api_node.identity, "POST", path, over, when)}
            stale = await client.post(POLICY, content=other, headers=headers)
            assert "refused a node-signed request" in error_of(stale, 403, "forbidden")["message"]
        # Operator-only calls take no signature, not even a voter's.
        for path in OPERATOR_ONLY:
            signed_call = await client.post(
                path, content=b"{}", headers=api_node.signed(path, b"{}")
            )
            assert "operator only" in error_of(signed_call, 403, "forbidden")["message"]
    assert api_node.raft.ledger.policy_settings() == {"cooldown_s": 30.0}
    assert not api_node.members.isolated


async def test_a_member_may_ask_for_its_own_bootstrap_assignment_only(api_node: ApiNode) -> None:
    member, stranger = Identity.generate(), Identity.generate()
    api_node.members.add(member.node_id)

    def assign(key: Identity, target: bytes) -> tuple[bytes, dict[str, str]]:
        body = json.dumps({"node_id": node_id_text(target), "model": "m", "layers": [0, 4]})
        return body.encode(), api_node.signed(NODES_ASSIGN, body.encode(), key)

    async with client_of(api_node) as client:
        for key, target in [
            (stranger, stranger.node_id),  # not a member
            (member, stranger.node_id),  # a member, for another node
        ]:
            body, headers = assign(key, target)
            refused = await client.post(NODES_ASSIGN, content=body, headers=headers)
            assert "own bootstrap assignment" in error_of(refused, 403, "forbidden")["message"]
        body, headers = assign(member, member.node_id)
        accepted = await client.post(NODES_ASSIGN, content=body, headers=headers)
        assert accepted.status_code == 200 and accepted.json()["accepted"], accepted.text
    held = api_node.raft.ledger.assignment(member.node_id)
    assert held is not None and held.model == "m"
    assert api_node.raft.ledger.assignment(stranger.node_id) is None


@pytest.mark.parametrize(
    ("state", "live"),
    [
        (MemberState.ALIVE, True),
        (MemberState.SUSPECT, True),
        (MemberState.DEAD, False),
        (MemberState.LEFT, False),
        (None, False),
    ],
)
async def test_only_a_live_member_reports_demand(
    api_node: ApiNode, state: MemberState | None, live: bool
) -> None:
    reporter = Identity.generate()
    if state is not None:
        api_node.members.add(reporter.node_id, state)
    assert Gate(api_node).live_member(reporter.node_id) is live
    body = json.dumps({"model": "m"}).encode()
    async with client_of(api_node) as client:
        answer = await client.post(
            DEMAND, content=body, headers=api_node.signed(DEMAND, body, reporter)
        )
    if live:  # past the gate: no member serves "m", so the leader refuses to record it
        error_of(answer, 404, "model_not_found")
    else:
        error = error_of(answer, 403, "forbidden")
        assert "not a live member" in error["message"] and "report demand" in error["message"]
    assert api_node.raft.ledger.demand() == {}


# --- the token file ----------------------------------------------------------------


def test_the_operator_token_is_made_once_private_and_kept(tmp_path: Path) -> None:
    with StateDir(tmp_path) as state:
        token = state.operator_token()
    path = tmp_path / OPERATOR_TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) >= 40 and path.read_text() == token + "\n"
    with StateDir(tmp_path) as state:
        assert state.operator_token() == token  # the same across runs
    assert read_operator_token(tmp_path) == token
    other = tmp_path / "other"
    other.mkdir()
    assert load_or_create_operator_token(other) != token  # each node its own

    path.chmod(0o640)
    with pytest.raises(StateDirError, match="must be private"):
        load_or_create_operator_token(tmp_path)
    path.chmod(0o600)
    path.write_text("")  # a crash between creating and writing it
    fresh = load_or_create_operator_token(tmp_path)
    assert fresh and fresh != token and read_operator_token(tmp_path) == fresh
    with pytest.raises(StateDirError, match="no operator token"):
        read_operator_token(tmp_path / "nowhere")


def test_a_node_refuses_to_start_with_a_readable_token(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / OPERATOR_TOKEN_FILE).write_text("secret\n")
    (state / OPERATOR_TOKEN_FILE).chmod(0o644)
    done = subprocess.run(
        [*shardmesh_command(), "node", "--listen", "127.0.0.1:0", "--state-dir", str(state)],
        capture_output=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 1
    assert b"operator.token has mode 644; the operator token must be private" in done.stderr


def test_the_cli_finds_the_token_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node_dir, default_dir = tmp_path / "node", tmp_path / "default"
    node_dir.mkdir()
    default_dir.mkdir()
    from_dir = load_or_create_operator_token(node_dir)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.setattr(token_module, "default_state_dir", lambda: default_dir)
    env = {TOKEN_ENV: "from-env"}

    assert find_token(token_file, None, env).value == "from-file"
    assert find_token(None, node_dir, env).value == from_dir
    assert find_token(None, None, env).value == "from-env"
    found = find_token(None, None, {})
    assert found.value is None and "none was found" in found.refused()
    from_default = load_or_create_operator_token(default_dir)
    assert find_token(None, None, {}).value == from_default  # the node on this machine
    with pytest.raises(TokenError, match="--token-file"):
        find_token(tmp_path / "missing", None, env)
    with pytest.raises(TokenError, match="no operator token"):
        find_token(None, tmp_path, env)
    assert find_token(token_file, None, env).headers() == {"authorization": "Bearer from-file"}


# --- a real node ------------------------------------------------------------------


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"], error
    return error


async def settings(client: httpx.AsyncClient, node: LocalNode) -> dict[str, Any]:
    shown = await client.get(node.api + POLICY)
    assert shown.status_code == 200
    result: dict[str, Any] = shown.json()["settings"]
    return result


async def until_committed(
    client: httpx.AsyncClient, url: str, body: bytes, headers: Callable[[], dict[str, str]]
) -> httpx.Response:
    """POST until the answer is not a 503 (the node's first election),
    with fresh `headers()` each time (a signature is accepted once)."""
    with trio.fail_after(15):
        while (
            response := await client.post(url, content=body, headers=headers())
        ).status_code == 503:
            await trio.sleep(0.1)
    return response


def signed(key: Identity, path: str, body: bytes, now: float) -> dict[str, str]:
    """A POST of `body` to `path` as the node with `key`, signed at `now`."""
    return {"content-type": "application/json", **sign_request(key, "POST", path, body, now)}


async def test_admin_calls_need_the_token_and_json_and_nothing_changes_without(
    swarm: LocalSwarm,
) -> None:
    node = swarm.new_node()
    await swarm.start_ready(node, timeout=START_TIMEOUT_S)
    token = (node.state_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    assert stat.S_IMODE((node.state_dir / OPERATOR_TOKEN_FILE).stat().st_mode) == 0o600
    assert f"operator token in {node.state_dir / OPERATOR_TOKEN_FILE}" in node.log_tail(200)
    body = json.dumps(CHANGE).encode()
    as_json = {"content-type": "application/json"}
    bearer = {"authorization": f"Bearer {token}"}

    async with httpx.AsyncClient(timeout=15) as client:
        url = node.api + POLICY
        # No credential, a wrong one, another scheme: 401, nothing committed.
        for headers in [{}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {token}"}]:
            refused = await client.post(url, content=body, headers={**as_json, **headers})
            assert_error(refused, 401, "unauthorized")
            assert refused.headers["www-authenticate"] == "Bearer"
            assert "operator token" in refused.json()["error"]["message"]
        # The right token as text/plain (what a web page can send cross-site): 415.
        plain = await client.post(
            url, content=body, headers={**bearer, "content-type": "text/plain"}
        )
        assert_error(plain, 415, "unsupported_media_type")
        form = await client.post(url, data=CHANGE, headers=bearer)
        assert_error(form, 415, "unsupported_media_type")
        assert await settings(client, node) == {}

        # Every admin route, not only the policy.
        assign = {"node_id": node.node_id, "model": "ghost", "layers": [0, 4], "recipe": "fp32"}
        for path, payload in [
            (NODES_ASSIGN, assign),
            ("/v1/network/assign", {"memory_bytes": 1, "models": []}),
            ("/v1/debug/faults", {"isolate": True}),
        ]:
            refused = await client.post(node.api + path, json=payload)
            assert_error(refused, 401, "unauthorized")
        status = (await client.get(node.api + "/v1/network/status")).json()
        assert status["ledger"] == []

        # Chat is public (no 401, the model is simply unknown) but JSON only too.
        chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
        answer = await client.post(node.api + "/v1/chat/completions", json=chat)
        assert answer.status_code == 404, answer.text
        plain_chat = await client.post(
            node.api + "/v1/chat/completions",
            content=json.dumps(chat).encode(),
            headers={"content-type": "text/plain"},
        )
        assert_error(plain_chat, 415, "unsupported_media_type")

        # No CORS, ever: a preflight is not answered with permission, nor a POST.
        origin = {"origin": "https://evil.example"}
        preflight = await client.options(
            url,
            headers={
                **origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )
        posted = await client.post(url, content=body, headers={**origin, **as_json, **bearer})
        for response in (preflight, posted, await client.get(url, headers=origin)):
            assert not [h for h in response.headers if h.lower().startswith("access-control-")]

        # With the token (and a charset): committed.
        assert posted.status_code in (200, 503)
        changed = await until_committed(
            client, url, body, lambda: {**bearer, "content-type": "application/json; charset=utf-8"}
        )
        assert changed.status_code == 200 and changed.json()["accepted"], changed.text
        assert await settings(client, node) == {"idle_release_s": 600.0}

        # Fault injection with the token works (and is undone).
        for on in (True, False):
            cut = await client.post(
                node.api + "/v1/debug/faults", json={"isolate": on}, headers=bearer
            )
            assert cut.status_code == 200 and cut.json() == {"isolated": on}


async def test_node_signed_calls_are_checked_against_who_signed(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    # A model in the node's store: demand is only for models the swarm can serve.
    make_tiny_model(tmp_path / "store" / "m", layers=2, name="m")
    node = swarm.new_node(args=["--models", str(tmp_path / "store")])
    await swarm.start_ready(node, timeout=START_TIMEOUT_S)
    stranger = Identity.generate()  # a key that is neither a voter nor a member
    key = Identity.load_or_create(node.state_dir)  # the node's own (a voter's)
    async with httpx.AsyncClient(timeout=15) as client:
        url = node.api + POLICY
        # The node founded the swarm: it is a voter, so its own signature
        # passes (as a forward from a voter would), once it leads.
        body = json.dumps({"cooldown_s": 30}).encode()
        headers = node.signed_headers(POLICY, body)
        by_voter = await until_committed(client, url, body, lambda: headers)
        assert by_voter.status_code == 200 and by_voter.json()["accepted"], by_voter.text
        # The same signed request again (a copy captured on the way): refused.
        replay = await client.post(url, content=body, headers=headers)
        assert "already used" in assert_error(replay, 403, "forbidden")["message"]

        # A signed forward from a non-voter: 403, nothing changed.
        body = json.dumps(CHANGE).encode()
        headers = signed(stranger, POLICY, body, time.time())
        error = assert_error(
            await client.post(url, content=body, headers=headers), 403, "forbidden"
        )
        assert "only a Raft voter's" in error["message"]
        # A voter's signature that is stale, or made over another body: 403.
        for when, over in [(time.time() - 120, body), (time.time(), b'{"cooldown_s": 1}')]:
            headers = signed(key, POLICY, over, when)
            refused = await client.post(url, content=body, headers=headers)
            assert_error(refused, 403, "forbidden")
        assert await settings(client, node) == {"cooldown_s": 30.0}

        # A bootstrap assignment signed by a stranger, for itself or another: 403.
        for target in (stranger.node_id, Identity.generate().node_id):
            assign = {"node_id": node_id_text(target), "model": "ghost", "layers": [0, 4]}
            payload = json.dumps(assign).encode()
            headers = signed(stranger, NODES_ASSIGN, payload, time.time())
            refused = await client.post(node.api + NODES_ASSIGN, content=payload, headers=headers)
            assert_error(refused, 403, "forbidden")

        # Demand: only a member's signed report. Unsigned (with or without the
        # operator token), or a stranger's: 403, never committed.
        demand_url = node.api + DEMAND
        payload = json.dumps({"model": "m"}).encode()
        for headers in [
            {"content-type": "application/json"},
            {"content-type": "application/json", **node.admin_headers()},
            signed(stranger, DEMAND, payload, time.time()),
        ]:
            refused = await client.post(demand_url, content=payload, headers=headers)
            assert_error(refused, 403, "forbidden")
        status = (await client.get(node.api + "/v1/network/status")).json()
        assert status["demand"] == {} and status["ledger"] == []
        # A member's report is recorded.
        recorded = await until_committed(
            client, demand_url, payload, lambda: node.signed_headers(DEMAND, payload)
        )
        assert recorded.status_code == 200, recorded.text
        status = (await client.get(node.api + "/v1/network/status")).json()
        assert set(status["demand"]) == {"m"}


async def test_an_operator_call_through_a_follower_is_forwarded_signed(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    make_tiny_model(tmp_path / "store" / "m", layers=2, name="m")
    first, second = swarm.new_node(), swarm.new_node(args=["--models", str(tmp_path / "store")])
    await swarm.start_ready(first, timeout=START_TIMEOUT_S)
    await swarm.start_ready(second, [first.seed], timeout=START_TIMEOUT_S)
    await swarm.make_eligible(first, [second], timeout=START_TIMEOUT_S)

    def second_votes(views: dict[str, Any]) -> bool:
        view = views.get(first.name) or {}
        voters = view.get("raft", {}).get("voters", [])
        return view.get("leader") == first.node_id and second.node_id in voters

    await wait_for(swarm, [first], second_votes, 20.0, "the second node is a voter")
    body = json.dumps(CHANGE).encode()
    async with httpx.AsyncClient(timeout=15) as client:
        url = second.api + POLICY
        # Each node has its own token: the first's is no good on the second.
        headers = {"content-type": "application/json", **first.admin_headers()}
        assert_error(await client.post(url, content=body, headers=headers), 401, "unauthorized")
        # The second's own token: it signs the forward, the leader checks a voter signed.
        headers = {"content-type": "application/json", **second.admin_headers()}
        forwarded = await until_committed(client, url, body, lambda: headers)
        assert forwarded.status_code == 200, forwarded.text
        assert forwarded.json()["leader"] == first.node_id and forwarded.json()["accepted"]
        # A member's signed demand report, sent to a follower, is relayed with
        # the member's own signature and recorded by the leader.
        payload = json.dumps({"model": "m"}).encode()
        relayed = await until_committed(
            client, second.api + DEMAND, payload, lambda: second.signed_headers(DEMAND, payload)
        )
        assert relayed.status_code == 200 and relayed.json()["leader"] == first.node_id


async def test_the_policy_cli_reads_the_token_from_each_source(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    node = swarm.new_node()
    await swarm.start_ready(node, timeout=START_TIMEOUT_S)
    empty_home = tmp_path / "home"  # no default state dir with a token in it
    empty_home.mkdir()
    base_env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    base_env.update(HOME=str(empty_home), XDG_STATE_HOME=str(empty_home / "state"))
    token_file = tmp_path / "token"
    token_file.write_text(node.operator_token + "\n")

    async def policy(value: int, *flags: str, env: dict[str, str] | None = None) -> Any:
        with trio.fail_after(CLI_TIMEOUT_S):
            return await trio.run_process(
                [*shardmesh_command(), "policy", "--api", node.api, *flags,
                 "--set", f"cooldown_s={value}", "--json"],
                capture_stdout=True, capture_stderr=True, check=False,
                env={**base_env, **(env or {})},
            )  # fmt: skip

    # None found: the node's 401 becomes one line saying where a token comes from.
    missing = await policy(11)
    assert missing.returncode == 1
    lines = missing.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "none was found" in lines[0] and TOKEN_ENV in lines[0], lines
    wrong = await policy(12, env={TOKEN_ENV: "not-the-token"})
    assert wrong.returncode == 1
    assert b"refused the operator token from SHARDMESH_TOKEN" in wrong.stderr
    absent = await policy(13, "--token-file", str(tmp_path / "absent"))
    assert absent.returncode == 1 and b"--token-file" in absent.stderr

    for value, flags, env in [
        (21, ("--state-dir", str(node.state_dir)), None),
        (22, ("--token-file", str(token_file)), None),
        (23, (), {TOKEN_ENV: node.operator_token}),
    ]:
        done = await policy(value, *flags, env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["settings"] == {"cooldown_s": float(value)}
