"""Spot checks connected to the leader: evidence to its queue or its API, verdicts into Raft."""

from __future__ import annotations

import json
from typing import Any, cast

import numpy as np
import pytest
import trio

from consensus.commands import Verdict
from mesh.identity import Identity
from runtime.inference.commitment import SKETCH_DIMS, Commitment
from runtime.model.sampling import SamplingParams
from runtime.node.hostport import HostPort
from runtime.node.http_server import start_http
from runtime.node.raft_driver import Committed, NotLeader, ProposalFailed
from runtime.node.signed_http import SIGNED_AT, verify_request
from runtime.node.spot_check import EVIDENCE_PATH, Evidence
from runtime.node.verification import Verification

ACCUSED, LEADER = b"\x0a" * 32, b"\x0b" * 32
VERDICT = Verdict(accused=ACCUSED, reporter=b"\x0c" * 32, evidence=b"d" * 32, guilty=True, at=1.0)


class Raft:
    """The Raft driver's surface here: who leads, and proposals."""

    def __init__(self, *, leading: bool, outcome: Committed | Exception | None = None) -> None:
        self.is_leader = leading
        self.outcome = outcome
        self.proposed: list[object] = []
        self.ledger: Any = None

    def leader(self) -> bytes | None:
        return LEADER

    async def propose(self, command: object) -> Committed:
        self.proposed.append(command)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome


class Swarm:
    def __init__(self, api: str | None) -> None:
        self.api = api
        self.node_id = b"\x0c" * 32

    def member_api(self, node: bytes) -> str | None:
        return self.api if node == LEADER else None


def evidence(reporter: bytes) -> Evidence:
    rows = np.zeros((1, SKETCH_DIMS), dtype=np.float32)
    commitment = Commitment(
        ACCUSED, reporter, "ab" * 16, "m", (0, 4), 1, 0, 0, 1, b"", rows, rows, None
    )
    return Evidence(
        reporter=reporter,
        kind="output",
        hop_index=0,
        model="m",
        prompt=(1, 2),
        tokens=(3,),
        sampling=SamplingParams(),
        seed=7,
        layers=((0, 4),),
        commitment=commitment,
    )


def verification(
    raft: Raft, api: str | None = None, signer: Identity | None = None
) -> Verification:
    return Verification(
        swarm=cast(Any, Swarm(api)),
        pipeline=cast(Any, None),
        raft=cast(Any, raft),
        signer=signer or Identity.generate(),
    )


async def test_the_leader_queues_its_own_evidence() -> None:
    wired = verification(Raft(leading=True))
    assert await wired.report(evidence(b"\x0c" * 32))
    assert wired.adjudicator.counters == {}


async def test_no_known_leader_api_means_not_delivered() -> None:
    assert not await verification(Raft(leading=False), api=None).report(evidence(b"\x0c" * 32))


async def test_a_follower_posts_signed_evidence_to_the_leader() -> None:
    reporter = Identity.generate()
    received: list[tuple[dict[str, str], bytes, str]] = []

    async def leader_api(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        received.append((headers, body, scope["path"]))
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await start_http(
            nursery, leader_api, bind=HostPort("127.0.0.1", 0), advertise=None, shutdown=shutdown
        )
        wired = verification(Raft(leading=False), api=url, signer=reporter)
        sent = evidence(reporter.node_id)
        assert await wired.report(sent)
        shutdown.set()
    ((headers, body, path),) = received
    assert path == EVIDENCE_PATH
    signed_at = float(headers[SIGNED_AT])
    assert verify_request(headers, "POST", path, body, signed_at) == reporter.node_id
    assert json.loads(body) == sent.to_json()


@pytest.mark.parametrize(
    ("outcome", "committed"),
    [
        (Committed(index=5, term=1, accepted=True), True),
        (Committed(index=5, term=1, accepted=False, reason="stale"), False),
        (NotLeader(None), False),
        (ProposalFailed("lost"), False),
    ],
)
async def test_a_verdict_is_committed_or_says_why_not(
    outcome: Committed | Exception, committed: bool
) -> None:
    raft = Raft(leading=True, outcome=outcome)
    assert await verification(raft).commit(VERDICT) is committed
    assert raft.proposed == [VERDICT]
