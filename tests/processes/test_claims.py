"""A node that claims absurd throughput does not attract the traffic (issue 18).

Real node processes on loopback: two replicas of a tiny model, one planted
with a fault that makes its capability report claim 5.4e11 decode tokens/s
(its honest replica's doctor measures a few hundred), and an entry that
serves nothing. Before the fix, routes were priced by the claim and the
liar carried every request; now the entry prices each hop by what it
observed the hop's steps take, so the liar carries at most the request
that gets it observed, and the honest replica the rest.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from runtime.cli.localswarm import LocalSwarm
from runtime.model.tiny import make_tiny_model
from tests.swarm_helpers import ADMIT_TIMEOUT_S, START_TIMEOUT_S, fault_env, serving, wait_for

MODEL = "tiny"
LIAR_CLAIM = 5.4e11
"""What the node of issue 18 claimed, against its honest replica's 247."""
REQUESTS = 8
MAX_TOKENS = 6
"""A few decode steps each: enough for the entry to time them."""
MAX_LIAR_REQUESTS = 2
"""What the brief allows. Requests go one at a time, so in practice it is
one: the request that gets the liar observed (nothing was observed yet to
cap its claim by); from then on it is caught overclaiming."""
REQUEST_TIMEOUT_S = 30.0


@pytest.mark.slow
async def test_a_node_claiming_absurd_throughput_does_not_attract_the_traffic(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    model_dir = make_tiny_model(tmp_path / "models" / MODEL, layers=4, name=MODEL)
    serve = ["--model", str(model_dir), "--layers", "0:4"]
    entry = swarm.new_node("entry")
    honest = swarm.new_node("honest", args=serve)
    liar = swarm.new_node("liar", args=serve, env=fault_env("claim_speed", str(LIAR_CLAIM)))
    await swarm.start_ready(entry, timeout=START_TIMEOUT_S)
    await swarm.start_many([honest, liar], [entry.seed], timeout=START_TIMEOUT_S)
    await wait_for(
        swarm, [entry], serving(entry, MODEL, [honest, liar]), ADMIT_TIMEOUT_S, "both replicas"
    )

    status = await swarm.status(entry)
    assert status is not None
    claims = {n["node_id"]: n["decode_tokens_per_s"] for n in status["coverage"][MODEL]["nodes"]}
    # The fault is planted: the liar's signed report claims the absurd rate.
    assert claims[liar.node_id] == LIAR_CLAIM
    assert claims[honest.node_id] < LIAR_CLAIM / 1e6

    routes = []
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Who carries this request?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(REQUESTS):
            response = await client.post(entry.api + "/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            routes.append(response.json()["shardmesh"]["route"])

    carried = {
        name: sum(route == [node.node_id] for route in routes)
        for name, node in (("honest", honest), ("liar", liar))
    }
    assert carried["liar"] + carried["honest"] == REQUESTS, routes
    assert carried["liar"] <= MAX_LIAR_REQUESTS, (carried, routes)

    # The operator can see why: what the entry observed each replica take.
    status = await swarm.status(entry)
    assert status is not None
    observed = status["chat"]["observed_step_ms"]
    assert set(observed) == {honest.node_id, liar.node_id}, (observed, liar.node_id, routes)
    assert all(ms > 0 for ms in observed.values()), observed
