"""The swarm's own routes (`runtime.api.network`), in process.

Each route class is driven through httpx's ASGI transport against an
`ApiNode` (tests/runtime/api/inprocess.py): a real one-voter Raft driver and
ledger, real placement, access, follower and adjudicator. Every answer is
checked for its status and OpenAI-shaped body, bad input for a 4xx that
names what is wrong (never a 500), and forwarding to the leader against a
second app served on loopback. Who may call is tests/runtime/api/test_auth.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from consensus.commands import Found, Verdict
from consensus.invitations import decode_invitation, redemption_bytes
from mesh.identity import Identity, node_id_text
from runtime.api.http import MAX_BODY_BYTES
from runtime.api.leader import FORWARDED_HEADER
from runtime.api.network import MAX_DEMAND_COUNT, network_routes
from runtime.model.manifest import GOLDEN_FILE, MANIFEST_FILE
from runtime.model.sampling import SamplingParams
from runtime.model.store import ModelStore
from runtime.node.access import DEFAULT_VOTER_INVITATION_S
from runtime.node.direct_paths import PUNCH_PATH
from runtime.node.ledger_follower import LEDGER_PATH, verify_pull
from runtime.node.raft_driver import RaftDriver
from runtime.node.spot_check import EVIDENCE_PATH, MAX_PENDING_VERDICTS, Evidence
from tests.runtime.api.inprocess import (
    BEARER,
    ApiNode,
    FollowerRaft,
    body_of,
    client_of,
    error_of,
    leading_node,
    make_node,
    served,
)
from tests.runtime.inference.test_verify_engine import signed_commitment

POLICY = "/v1/network/policy"
VOTERS = "/v1/network/voters"
DEMAND = "/v1/network/demand"
NODES_ASSIGN = "/v1/nodes/assign"
SUGGEST = "/v1/network/assign"
INVITE = "/v1/network/invitations"
JOIN = "/v1/network/join"
FAULTS = "/v1/debug/faults"
REFOUND = "/v1/network/refound"
MODEL = "m"


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[ApiNode]:
    async with leading_node(tmp_path) as leading:
        yield leading


def assignment(node_id: bytes, model: str = MODEL, **overrides: Any) -> dict[str, Any]:
    return {"node_id": node_id_text(node_id), "model": model, "layers": [0, 4], **overrides}


async def test_the_routes_are_the_documented_paths_and_methods(node: ApiNode) -> None:
    routes = {route.path: route.methods for route in network_routes(node)}
    assert routes == {
        "/v1/network/artifacts/{digest}/{name}": {"GET", "HEAD"},
        "/v1/network/models/{name}/manifest": {"GET", "HEAD"},
        "/v1/network/status": {"GET", "HEAD"},
        "/v1/network/coverage": {"GET", "HEAD"},
        DEMAND: {"POST"},
        EVIDENCE_PATH: {"POST"},
        PUNCH_PATH: {"POST"},
        POLICY: {"GET", "HEAD", "POST"},
        SUGGEST: {"POST"},
        NODES_ASSIGN: {"POST"},
        FAULTS: {"POST"},
        LEDGER_PATH: {"GET", "HEAD"},
        VOTERS: {"GET", "HEAD", "POST"},
        REFOUND: {"POST"},
        INVITE: {"POST"},
        JOIN: {"POST"},
    }


# --- status and coverage -------------------------------------------------------------


async def test_status_and_coverage_read_the_status_document(node: ApiNode) -> None:
    node.coverage = {MODEL: {"layers": 4, "gaps": []}, "other": {"layers": 2, "gaps": [[0, 2]]}}
    async with client_of(node) as client:
        status = await client.get("/v1/network/status")
        assert status.status_code == 200 and status.json() == node.status()
        everything = await client.get("/v1/network/coverage")
        assert everything.json() == node.coverage
        one = await client.get("/v1/network/coverage", params={"model": MODEL})
        assert one.status_code == 200 and one.json() == {MODEL: node.coverage[MODEL]}
        missing = await client.get("/v1/network/coverage", params={"model": "ghost"})
        error = error_of(missing, 404, "model_not_found")
        assert error["param"] == "model" and "'ghost'" in error["message"]


# --- a model's files -----------------------------------------------------------------


async def test_a_stored_models_shareable_files_are_served_and_nothing_else(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    store = ModelStore({})
    stored = store.add(qwen3_dir)
    async with leading_node(tmp_path, store) as node, client_of(node) as client:
        manifest = await client.get(f"/v1/network/models/{stored.name}/manifest")
        assert manifest.status_code == 200
        assert manifest.headers["content-type"] == "application/json"
        assert manifest.content == (qwen3_dir / MANIFEST_FILE).read_bytes()
        error_of(await client.get("/v1/network/models/ghost/manifest"), 404, "not_found")

        files = f"/v1/network/artifacts/{stored.digest}"
        by_digest = await client.get(f"{files}/manifest")
        assert by_digest.content == (qwen3_dir / MANIFEST_FILE).read_bytes()
        for name in ("config.json", "tokenizer.json", GOLDEN_FILE):
            answer = await client.get(f"{files}/{name}")
            assert answer.status_code == 200, name
            assert answer.headers["content-type"] == "application/octet-stream"
            assert answer.content == (qwen3_dir / name).read_bytes()
        # The weights, or any other file, are not shared this way.
        for name in ("model.safetensors", "generation_config.json", MANIFEST_FILE + ".bak"):
            refused = error_of(await client.get(f"{files}/{name}"), 404)
            assert "not a shareable file" in refused["message"]
        unknown = error_of(await client.get(f"/v1/network/artifacts/{'0' * 64}/manifest"), 404)
        assert "no model with digest" in unknown["message"]


# --- policy ------------------------------------------------------------------------------


async def test_the_policy_is_shown_and_changed_by_the_operator(node: ApiNode) -> None:
    async with client_of(node) as client:
        shown = await client.get(POLICY)
        assert shown.status_code == 200 and shown.json()["settings"] == {}
        assert "idle_release_s" in shown.json()["policy"]
        changed = await client.post(POLICY, json={"idle_release_s": 600}, headers=BEARER)
        assert changed.status_code == 200, changed.text
        reply = changed.json()
        assert reply["accepted"] and reply["leader"] == node_id_text(node.node_id)
        assert reply["settings"] == {"idle_release_s": 600.0}
        assert reply["policy"]["idle_release_s"] == 600.0
        assert reply["index"] >= 1 and reply["term"] >= 1
        assert (await client.get(POLICY)).json()["settings"] == {"idle_release_s": 600.0}
        # HEAD is a read; any other method is refused naming the allowed ones.
        head = await client.head(POLICY)
        assert head.status_code == 200
        put = error_of(await client.put(POLICY, json={}, headers=BEARER), 405)
        assert put["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, None, "name at least one setting"),
        ({"no_such_knob": 1}, "no_such_knob", ""),
        ({"idle_release_s": "soon"}, "idle_release_s", ""),
        ({"idle_release_s": -1}, "idle_release_s", ""),
    ],
)
async def test_a_bad_policy_is_a_400_naming_the_knob(
    node: ApiNode, body: dict[str, Any], param: str | None, words: str
) -> None:
    async with client_of(node) as client:
        refused = error_of(await client.post(POLICY, json=body, headers=BEARER), 400)
        assert refused["param"] == param and words in refused["message"]
        assert (await client.get(POLICY)).json()["settings"] == {}


# --- demand and assignments -----------------------------------------------------------


async def test_demand_is_recorded_from_a_members_report_for_a_known_model(
    node: ApiNode,
) -> None:
    member = Identity.generate()
    node.members.add(member.node_id)
    async with client_of(node) as client:
        unknown = body_of({"model": MODEL})
        refused = await client.post(
            DEMAND, content=unknown, headers=node.signed(DEMAND, unknown, member)
        )
        assert error_of(refused, 404, "model_not_found")["param"] == "model"
        assert node.raft.ledger.demand() == {}
        # Once the ledger assigns the model to someone, demand for it is recorded.
        assigned = await client.post(NODES_ASSIGN, json=assignment(member.node_id), headers=BEARER)
        assert assigned.status_code == 200 and assigned.json()["accepted"], assigned.text
        report = body_of({"model": MODEL, "count": 3})
        recorded = await client.post(
            DEMAND, content=report, headers=node.signed(DEMAND, report, member)
        )
        assert recorded.status_code == 200 and recorded.json()["accepted"], recorded.text
    assert node.raft.ledger.demand()[MODEL].count == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "model"),
        ({"model": ""}, "model"),
        ({"model": "x" * 1000}, "model"),
        ({"model": 7}, "model"),
        ({"model": MODEL, "count": 0}, "count"),
        ({"model": MODEL, "count": MAX_DEMAND_COUNT + 1}, "count"),
        ({"model": MODEL, "count": 1.5}, "count"),
        ({"model": MODEL, "count": True}, "count"),
    ],
)
async def test_a_bad_demand_report_is_a_400(
    node: ApiNode, body: dict[str, Any], param: str
) -> None:
    member = Identity.generate()
    node.members.add(member.node_id)
    payload = body_of(body)
    async with client_of(node) as client:
        refused = await client.post(
            DEMAND, content=payload, headers=node.signed(DEMAND, payload, member)
        )
        assert error_of(refused, 400)["param"] == param


async def test_a_bootstrap_assignment_commits_once(node: ApiNode) -> None:
    joining = Identity.generate().node_id
    async with client_of(node) as client:
        first = await client.post(NODES_ASSIGN, json=assignment(joining), headers=BEARER)
        assert first.status_code == 200 and first.json()["accepted"], first.text
        held = node.raft.ledger.assignment(joining)
        assert held is not None and (held.model, held.layers, held.tier) == (
            MODEL,
            (0, 4),
            "bootstrap",
        )
        again = await client.post(
            NODES_ASSIGN, json=assignment(joining, model="other"), headers=BEARER
        )
        assert error_of(again, 409, "already_assigned")["param"] == "node_id"


async def test_a_quarantined_node_is_assigned_nothing(node: ApiNode) -> None:
    liar, reporter = Identity.generate().node_id, Identity.generate().node_id
    committed = await node.raft.propose(Verdict(liar, reporter, b"\x07" * 32, True, time.time()))
    assert committed.accepted
    async with client_of(node) as client:
        refused = await client.post(NODES_ASSIGN, json=assignment(liar), headers=BEARER)
        assert "quarantined" in error_of(refused, 409, "quarantined")["message"]
    assert node.raft.ledger.assignment(liar) is None


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"node_id": "ab"}, "node_id"),
        ({"node_id": 5}, "node_id"),
        ({"node_id": "zz" * 32}, "node_id"),
        ({"model": ""}, "model"),
        ({"model": None}, "model"),
        ({"layers": [4, 4]}, "layers"),
        ({"layers": [0]}, "layers"),
        ({"layers": [-1, 2]}, "layers"),
        ({"layers": [0, 2.5]}, "layers"),
        ({"layers": "0-4"}, "layers"),
        ({"recipe": "fp3"}, "recipe"),
        ({"recipe": ["fp32"]}, "recipe"),  # unhashable: was a 500
        ({"layers": [0, 2**63]}, "layers"),  # past the ledger's 64 bits: was a 500
    ],
)
async def test_a_bad_assignment_is_a_400_naming_the_field(
    node: ApiNode, overrides: dict[str, Any], param: str
) -> None:
    body = {**assignment(Identity.generate().node_id), **overrides}
    async with client_of(node) as client:
        refused = await client.post(NODES_ASSIGN, json=body, headers=BEARER)
        assert error_of(refused, 400)["param"] == param
    assert node.raft.ledger.assignments() == ()


async def test_a_suggestion_checks_its_input_and_says_when_no_gap_fits(node: ApiNode) -> None:
    async with client_of(node) as client:
        for body, param in [
            ({"memory_bytes": -1, "models": []}, "memory_bytes"),
            ({"memory_bytes": 1.5, "models": []}, "memory_bytes"),
            ({"models": []}, "memory_bytes"),
            ({"memory_bytes": 1, "models": "m"}, "models"),
            ({"memory_bytes": 1, "models": [1]}, "models"),
        ]:
            refused = await client.post(SUGGEST, json=body, headers=BEARER)
            assert error_of(refused, 400)["param"] == param, body
        # Before the placement loop has seen the swarm, no gap is known.
        none = await client.post(
            SUGGEST, json={"memory_bytes": 1 << 30, "models": [MODEL]}, headers=BEARER
        )
        error_of(none, 404, "no_gap")


# --- voters, the ledger copy, refound ----------------------------------------------------


async def test_voters_are_shown_and_one_more_made_eligible(node: ApiNode) -> None:
    newcomer = Identity.generate().node_id
    async with client_of(node) as client:
        shown = await client.get(VOTERS)
        assert shown.status_code == 200 and shown.json() == node.raft.voters_view()
        assert shown.json()["voters"] == [node_id_text(node.node_id)]
        added = await client.post(VOTERS, json={"node_id": node_id_text(newcomer)}, headers=BEARER)
        assert added.status_code == 200 and added.json()["accepted"], added.text
        assert node_id_text(newcomer) in (await client.get(VOTERS)).json()["eligible"]
        for bad in ({}, {"node_id": "nope"}, {"node_id": 3}):
            refused = await client.post(VOTERS, json=bad, headers=BEARER)
            assert error_of(refused, 400)["param"] == "node_id"


async def test_the_ledger_copy_is_signed_and_is_the_ledger(node: ApiNode) -> None:
    await node.raft.propose(Found(node.node_id, "open", time.time()))
    async with client_of(node) as client:
        answer = await client.get(LEDGER_PATH)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/cbor"
    claim = verify_pull(node.node_id, answer.headers, answer.content, trusted=[node.node_id])
    assert claim.voters == (node.node_id,)
    assert claim.index == node.raft.ledger.applied_index and claim.term == node.raft.raft.term


async def test_a_leader_with_a_quorum_refuses_to_refound(node: ApiNode) -> None:
    async with client_of(node) as client:
        refused = await client.post(REFOUND, json={}, headers=BEARER)
        error_of(refused, 409, "cannot_refound")
        # JSON only, like every POST.
        error_of(
            await client.post(
                REFOUND, content=b"{}", headers={**BEARER, "content-type": "text/plain"}
            ),
            415,
        )


# --- spot-check evidence ---------------------------------------------------------------


def evidence_by(reporter: bytes) -> Evidence:
    hop = Identity.generate()
    commitment = signed_commitment(hop, reporter, layers=(0, 4), ids=[5, 6], token=7, model=MODEL)
    return Evidence(
        reporter=reporter,
        kind="output",
        hop_index=0,
        model=MODEL,
        prompt=(5, 6),
        tokens=(7,),
        sampling=SamplingParams(temperature=0.0),
        seed=0,
        layers=((0, 4),),
        commitment=commitment,
    )


async def test_evidence_is_queued_only_well_formed_from_its_reporter(node: ApiNode) -> None:
    member, other = Identity.generate(), Identity.generate()
    node.members.add(member.node_id)
    node.members.add(other.node_id)
    evidence = evidence_by(member.node_id)
    good = body_of(evidence.to_json())
    forged_json = evidence.to_json()
    forged_json["commitment"]["token"] = 8
    forged = body_of(forged_json)

    async def post(body: bytes, key: Identity) -> Any:
        return await client.post(
            EVIDENCE_PATH, content=body, headers=node.signed(EVIDENCE_PATH, body, key)
        )

    async with client_of(node) as client:
        assert (
            "malformed evidence"
            in error_of(await post(b'{"kind": "output"}', member), 400)["message"]
        )
        assert "signature" in error_of(await post(forged, member), 400)["message"]
        refused = error_of(await post(good, other), 403, "forbidden")
        assert "the entry that reports it" in refused["message"]
        queued = await post(good, member)
        assert queued.status_code == 202, queued.text
        assert queued.json() == {"queued": True, "digest": evidence.digest().hex()}
        for _ in range(MAX_PENDING_VERDICTS - 1):
            assert (await post(good, member)).status_code == 202
        busy = await post(good, member)
        error_of(busy, 429, "busy")
        assert busy.headers["retry-after"] == "5"


# --- direct paths ------------------------------------------------------------------------


async def test_a_punch_is_asked_by_a_member_well_formed_and_refused_while_no_address_is_known(
    node: ApiNode,
) -> None:
    member, stranger = Identity.generate(), Identity.generate()
    node.members.add(member.node_id)
    asked = {"plane": "data", "method": "reverse", "host": "10.77.1.2", "port": 45000}

    async def post(body: dict[str, Any], key: Identity) -> Any:
        content = body_of(body)
        return await client.post(
            PUNCH_PATH, content=content, headers=node.signed(PUNCH_PATH, content, key)
        )

    async with client_of(node) as client:
        error_of(await post(asked, stranger), 403, "forbidden")
        bad = error_of(await post({**asked, "host": "relay.example"}, member), 400)
        assert "unicast IP" in bad["message"]
        busy = await post(asked, member)
        assert "public address" in error_of(busy, 429, "busy")["message"]
        assert busy.headers["retry-after"] == "5"


# --- invitations and joins ---------------------------------------------------------------


async def test_an_open_swarm_issues_no_invitation(node: ApiNode) -> None:
    await node.raft.propose(Found(node.node_id, "open", time.time()))
    async with client_of(node) as client:
        refused = await client.post(INVITE, json={}, headers=BEARER)
        assert "open" in error_of(refused, 409, "cannot_invite")["message"]


async def test_an_invitation_is_issued_and_redeemed_by_its_newcomer(node: ApiNode) -> None:
    await node.raft.propose(Found(node.node_id, "private", time.time()))
    async with client_of(node) as client:
        for body, param in [({"voter": "yes"}, "voter"), ({"expires_s": "1h"}, "expires_s")]:
            assert (
                error_of(await client.post(INVITE, json=body, headers=BEARER), 400)["param"]
                == param
            )
        error_of(
            await client.post(INVITE, json={"expires_s": 0}, headers=BEARER), 409, "cannot_invite"
        )
        before = time.time()
        issued = await client.post(INVITE, json={"voter": True}, headers=BEARER)
        assert issued.status_code == 200, issued.text
        invitation = issued.json()
        assert invitation["swarm"] == node_id_text(node.node_id) and invitation["voter"] is True
        assert (
            before + DEFAULT_VOTER_INVITATION_S - 1
            <= invitation["expires_at"]
            <= time.time() + DEFAULT_VOTER_INVITATION_S
        )

        token = invitation["invitation"]
        decoded = decode_invitation(token)
        assert decoded.seed == f"{node_id_text(node.node_id)}@127.0.0.1:7001"
        assert decoded.api == node.addresses["api"]
        newcomer, stranger = Identity.generate(), Identity.generate()
        at = int(time.time())

        def redemption(key: Identity, node_id: bytes, when: int = at) -> dict[str, Any]:
            signature = key.sign(redemption_bytes(decoded, node_id, when)).hex()
            return {
                "invitation": token,
                "node_id": node_id_text(node_id),
                "at": when,
                "signature": signature,
            }

        # Someone else's signature over the newcomer's key, or a stale one: refused.
        for body in (
            redemption(stranger, newcomer.node_id),
            redemption(newcomer, newcomer.node_id, at - 3600),
        ):
            error_of(await client.post(JOIN, json=body), 403, "invitation_refused")
        for body, param in [
            ({**redemption(newcomer, newcomer.node_id), "at": "now"}, "invitation"),
            ({**redemption(newcomer, newcomer.node_id), "invitation": None}, "invitation"),
            ({**redemption(newcomer, newcomer.node_id), "node_id": "ab"}, "node_id"),
            ({**redemption(newcomer, newcomer.node_id), "signature": "zz"}, "node_id"),
        ]:
            assert error_of(await client.post(JOIN, json=body), 400)["param"] == param
        assert newcomer.node_id not in node.raft.ledger.admitted_keys()
        joined = await client.post(JOIN, json=redemption(newcomer, newcomer.node_id))
        assert joined.status_code == 200 and joined.json()["accepted"], joined.text
        assert newcomer.node_id in node.raft.ledger.admitted_keys()


# --- fault injection --------------------------------------------------------------------


async def test_fault_injection_is_off_unless_the_node_was_started_with_it(node: ApiNode) -> None:
    async with client_of(node) as client:
        off = error_of(await client.post(FAULTS, json={"isolate": True}, headers=BEARER), 404)
        assert "--fault-injection" in off["message"]
        assert not node.members.isolated
        node.fault_injection = True
        for isolate in (True, False):
            cut = await client.post(FAULTS, json={"isolate": isolate}, headers=BEARER)
            assert cut.status_code == 200 and cut.json() == {"isolated": isolate}
            assert node.members.isolated is isolate
        for bad in ({}, {"isolate": "yes"}, {"isolate": 1}):
            assert (
                error_of(await client.post(FAULTS, json=bad, headers=BEARER), 400)["param"]
                == "isolate"
            )


# --- bad bodies anywhere ----------------------------------------------------------------

OPERATOR_POSTS = [POLICY, VOTERS, NODES_ASSIGN, SUGGEST, INVITE, JOIN, FAULTS, REFOUND]
BAD_BODIES = [
    (b"{not json", "malformed JSON"),
    (b"\xff\xfe", "malformed JSON"),
    (b"", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
    (b"x" * (MAX_BODY_BYTES + 1), "over"),
    # Issue 30: each was a 500 (the parser's recursion, its int guard, encoders).
    (b"[" * 30_000 + b"]" * 30_000, "nests deeper than"),
    (b'{"invitation": "smi1.\\ud800", "model": "\\ud800"}', "lone surrogate"),
    (b'{"at": ' + b"9" * 5_000 + b"}", "out of range"),
    (b'{"isolate": NaN}', "NaN is not a JSON value"),
]


@pytest.mark.parametrize("path", [*OPERATOR_POSTS, DEMAND, EVIDENCE_PATH])
async def test_a_bad_body_is_a_4xx_that_says_why_never_a_500(node: ApiNode, path: str) -> None:
    """Malformed, not an object, oversized: a 400 saying so; a body not
    declared JSON: a 415. Past the gate, on every POST route."""
    node.fault_injection = True
    member = Identity.generate()
    node.members.add(member.node_id)

    def headers(content: bytes) -> dict[str, str]:
        return node.signed(path, content, member) if path in (DEMAND, EVIDENCE_PATH) else BEARER

    async with client_of(node) as client:
        for content, words in BAD_BODIES:
            answer = await client.post(path, content=content, headers=headers(content))
            if path == EVIDENCE_PATH and len(content) > MAX_BODY_BYTES:
                words = "malformed JSON"  # evidence may be larger (MAX_EVIDENCE_BYTES)
            assert words in error_of(answer, 400)["message"], (content[:20], answer.text)
        for declared in ("text/plain", "application/x-www-form-urlencoded"):
            answer = await client.post(
                path, content=b"{}", headers={**headers(b"{}"), "content-type": declared}
            )
            error_of(answer, 415, "unsupported_media_type")
    assert node.raft.ledger.policy_settings() == {} and not node.members.isolated


# --- forwarding to the leader -------------------------------------------------------------


def follower_of(node: ApiNode, raft: FollowerRaft) -> ApiNode:
    """A node like `node` (same parts) whose Raft driver follows elsewhere."""
    follower = make_node(node.raft, Identity.generate())
    follower.raft = cast(RaftDriver, raft)
    return follower


async def test_without_a_reachable_leader_a_call_is_a_503_to_retry(node: ApiNode) -> None:
    leader = Identity.generate().node_id
    cases = [
        (FollowerRaft(node.node_id, None), "no_leader"),
        (FollowerRaft(node.node_id, leader), "not_leader"),  # its API unknown
        (FollowerRaft(node.node_id, None, failing=True), "proposal_failed"),
    ]
    for raft, code in cases:
        follower = follower_of(node, raft)
        async with client_of(follower) as client:
            answer = await client.post(POLICY, json={"cooldown_s": 30}, headers=BEARER)
        error_of(answer, 503, code)
        assert answer.headers["retry-after"] == "1"
        if code == "not_leader":
            assert answer.json()["error"]["leader"] == node_id_text(leader)
    # Known but not answering (nothing listens there): 503 too.
    follower = follower_of(node, FollowerRaft(node.node_id, leader))
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        follower.apis = {leader: f"http://127.0.0.1:{sock.getsockname()[1]}"}
        async with client_of(follower) as client:
            answer = await client.post(POLICY, json={"cooldown_s": 30}, headers=BEARER)
    assert node_id_text(leader) in error_of(answer, 503, "leader_unreachable")["message"]


async def test_a_follower_forwards_once_signed_and_relays_the_leaders_answer(
    node: ApiNode,
) -> None:
    member = Identity.generate()
    node.members.add(member.node_id)
    assigned = await node.raft.propose(
        node.placement.bootstrap_command(member.node_id, MODEL, (0, 4), "fp32")
    )
    assert assigned.accepted
    async with served(node) as url:
        follower = follower_of(node, FollowerRaft(Identity.generate().node_id, node.node_id))
        follower.apis = {node.node_id: url}
        follower.members.add(member.node_id)
        async with client_of(follower) as client:
            # A member's demand report goes on with the member's own signature.
            report = body_of({"model": MODEL})
            relayed = await client.post(
                DEMAND, content=report, headers=node.signed(DEMAND, report, member)
            )
            assert relayed.status_code == 200, relayed.text
            assert relayed.json()["leader"] == node_id_text(node.node_id)
            # The operator's call goes on signed by the follower, which is no voter there.
            refused = await client.post(POLICY, json={"cooldown_s": 30}, headers=BEARER)
            assert "only a Raft voter's" in error_of(refused, 403, "forbidden")["message"]
            # A request forwarded once is not forwarded again.
            again = await client.post(
                POLICY, json={"cooldown_s": 30}, headers={**BEARER, FORWARDED_HEADER: "someone"}
            )
            error_of(again, 503, "not_leader")
    assert node.raft.ledger.policy_settings() == {}


async def test_evidence_reaching_a_follower_goes_on_to_the_leader(node: ApiNode) -> None:
    member = Identity.generate()
    node.members.add(member.node_id)
    evidence = evidence_by(member.node_id)
    body = body_of(evidence.to_json())
    async with served(node) as url:
        follower = follower_of(node, FollowerRaft(Identity.generate().node_id, node.node_id))
        follower.apis = {node.node_id: url}
        follower.members.add(member.node_id)
        async with client_of(follower) as client:
            answer = await client.post(
                EVIDENCE_PATH, content=body, headers=node.signed(EVIDENCE_PATH, body, member)
            )
    assert answer.status_code == 202, answer.text
    assert answer.json()["digest"] == evidence.digest().hex()
