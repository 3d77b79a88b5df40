"""A hop that lies after its doctor is caught, quarantined, and routed around (issue 18).

Real node processes on loopback: an entry that serves nothing (the founder,
so the Raft leader that judges evidence), two honest replicas of a tiny
model, and one liar at a time, planted with a fault from
tests/fault_hooks/lying_hop.py: (a) noise on every step, (b) noise on 1% of
steps, (c) a last hop that emits other tokens, (d) honest for its first
steps, then noise. The policy checks every finished request
(``verify_fraction`` 1) so the scenario is short; the entry replays each
request on the other replicas, reports what two replays confirm, the
leader recomputes once more and commits a Verdict, and from then on the
liar is out of coverage: later requests route around it. The honest
replicas are never quarantined, and the evidence is in the status.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.identity import Identity
from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from runtime.model.sampling import SamplingParams
from runtime.model.tiny import make_tiny_model
from runtime.node.spot_check import EVIDENCE_PATH, Evidence
from tests.runtime.inference.test_verify_engine import signed_commitment
from tests.swarm_helpers import (
    ADMIT_TIMEOUT_S,
    START_TIMEOUT_S,
    fault_env,
    serving,
    verify_every_request,
    wait_for,
)

MODEL = "tiny"
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 30.0
LIARS = {"noise": 12, "rare:0.01": 80, "swap": 12, "late:12": 30}
"""Each liar's mode and the most requests it may survive. With every
request checked, a liar is caught by the first checked request it lied in
that it carried: the always-liars within a dozen; the 1% liar lies in a
17-step request about one time in six; the late one serves its first 12
steps honestly, then lies. A newcomer carries the first request after it
joins (it is not measured yet); after that, routes prefer whichever replica
this entry measured fastest, so how many more it carries depends on the
machine's load: a later start (it was 40 steps) left the late liar
unrouted for 30 requests on a busy machine, and the test flaky."""
QUARANTINE_WAIT_S = 20.0
"""From the last request to the verdict: two replays at the entry, two at
the leader, one commit, on a loaded 2-core machine."""


def quarantined(entry: LocalNode, node: LocalNode) -> Any:
    def check(views: Views) -> bool:
        return node.node_id in (views.get(entry.name) or {}).get("quarantined", [])

    return check


async def _chat(client: httpx.AsyncClient, entry: LocalNode, n: int) -> list[str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Question number {n}: who answers?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = await client.post(entry.api + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    route: list[str] = response.json()["shardmesh"]["route"]
    return route


@pytest.mark.slow
async def test_each_kind_of_liar_is_quarantined_and_routed_around(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    model_dir = make_tiny_model(tmp_path / "models" / MODEL, layers=4, name=MODEL)
    serve = ["--model", str(model_dir), "--layers", "0:4"]
    entry = swarm.new_node("entry")
    honest = [swarm.new_node(f"honest{i}", args=serve) for i in range(2)]
    await swarm.start_ready(entry, timeout=START_TIMEOUT_S)
    await swarm.start_many(honest, [entry.seed], timeout=START_TIMEOUT_S)
    await wait_for(swarm, [entry], serving(entry, MODEL, honest), ADMIT_TIMEOUT_S, "two replicas")
    await verify_every_request(entry)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        requests = 0
        for mode, allowed in LIARS.items():
            name = "liar-" + mode.split(":")[0]
            liar = swarm.new_node(name, args=serve, env=fault_env("lying_hop", mode))
            await swarm.start_ready(liar, [entry.seed], timeout=START_TIMEOUT_S)
            await wait_for(swarm, [entry], serving(entry, MODEL, [liar]), ADMIT_TIMEOUT_S, name)
            for _ in range(allowed):
                await _chat(client, entry, requests)
                requests += 1
                status = await swarm.status(entry)
                assert status is not None
                if liar.node_id in status["quarantined"]:
                    break
            await wait_for(swarm, [entry], quarantined(entry, liar), QUARANTINE_WAIT_S, name)
            status = await swarm.status(entry)
            assert status is not None
            record = next(q for q in status["quarantine"] if q["node_id"] == liar.node_id)
            assert record["reason"] == "wrong_output" and record["evidence"], record
            assert status["not_serving"].get(liar.node_id) == "quarantined", status
            # From now on the liar carries nothing.
            for _ in range(3):
                assert await _chat(client, entry, requests) != [liar.node_id]
                requests += 1
            liar.kill()
    status = await swarm.status(entry)
    assert status is not None
    assert not {node.node_id for node in honest} & set(status["quarantined"]), status
    verify = status["verify"]
    # At least one guilty verdict per liar (requests checked before the
    # first verdict landed may bring more), and no report was false.
    assert verify["verdicts"].get("guilty", 0) >= len(LIARS), verify
    assert not verify["verdicts"].get("false_report"), verify


async def test_evidence_is_taken_only_well_formed_from_its_reporter(swarm: LocalSwarm) -> None:
    """`POST /v1/network/evidence`: unsigned, malformed, forged or someone
    else's evidence is refused with a reason; well-formed evidence is queued
    for the leader's recomputation, which, with no other node serving the
    accused's span, reaches no verdict (and says so) rather than guessing."""
    leader, member = swarm.new_node("leader"), swarm.new_node("member")
    await swarm.start_ready(leader)
    await swarm.start_ready(member, [leader.seed])
    hop = Identity.generate()
    member_id = bytes.fromhex(member.node_id)
    commitment = signed_commitment(hop, member_id, layers=(0, 4), ids=[5, 6], token=7, model=MODEL)
    evidence = Evidence(
        reporter=bytes.fromhex(member.node_id),
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
    good = json.dumps(evidence.to_json()).encode()
    forged_body = evidence.to_json()
    forged_body["commitment"]["token"] = 8  # no longer what the hop signed
    forged = json.dumps(forged_body).encode()
    url = leader.api + EVIDENCE_PATH

    async def post(body: bytes, signer: LocalNode | None) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if signer is not None:
            headers = signer.signed_headers(EVIDENCE_PATH, body)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            return await client.post(url, content=body, headers=headers)

    assert (await post(good, None)).status_code == 403  # no signature
    malformed = await post(b'{"kind": "output"}', member)
    assert malformed.status_code == 400 and "malformed evidence" in malformed.text
    refused = await post(forged, member)
    assert refused.status_code == 400 and "signature" in refused.text
    assert (await post(good, leader)).status_code == 403  # not the reporter
    queued = await post(good, member)
    assert queued.status_code == 202, queued.text
    assert queued.json()["digest"] == evidence.digest().hex()

    def judged(views: Views) -> bool:
        verdicts = (views.get(leader.name) or {}).get("verify", {}).get("verdicts", {})
        return verdicts.get("no_independent_chain", 0) >= 1

    await wait_for(swarm, [leader], judged, QUARANTINE_WAIT_S, "the evidence judged")
    status = await swarm.status(leader)
    assert status is not None and status["quarantined"] == []
