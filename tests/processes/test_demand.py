"""Demand that cannot be invented, on real node processes: the leader
commits demand only for a model some member can serve, and refuses
(counted, visible in the status drops) demand for any other, whether it was
sent to the leader or relayed by a follower.

The table's own bounds (size, decay) are the ledger's: `tests/consensus/test_ledger.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm
from runtime.model.tiny import make_tiny_model
from runtime.node.ledger_follower import LAZY_PULL_S
from tests.swarm_helpers import START_TIMEOUT_S, wait_for

DEMAND = "/v1/network/demand"
KNOWN = "m"
INVENTED = "invented-model"


async def report_demand(
    client: httpx.AsyncClient, to: LocalNode, model: str, *, signer: LocalNode | None = None
) -> httpx.Response:
    """A member's signed demand report for `model`, posted to `to` (retried
    while the swarm has no leader yet: 503)."""
    body = json.dumps({"model": model}).encode()
    headers = (signer or to).signed_headers(DEMAND, body)
    with trio.fail_after(20):
        while True:
            reply = await client.post(to.api + DEMAND, content=body, headers=headers)
            if reply.status_code != 503:
                return reply
            await trio.sleep(0.1)


def assert_refused(reply: httpx.Response) -> None:
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert INVENTED in error["message"]


@pytest.mark.slow
async def test_demand_for_a_model_no_member_can_serve_is_not_committed(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    make_tiny_model(tmp_path / "store" / KNOWN, layers=2, name=KNOWN)
    leader = swarm.new_node(args=["--models", str(tmp_path / "store")])
    follower = swarm.new_node()
    await swarm.start_ready(leader, timeout=START_TIMEOUT_S)
    await swarm.start_ready(follower, [leader.seed], timeout=START_TIMEOUT_S)

    def follower_knows_the_leader(views: dict[str, Any]) -> bool:
        view = views.get(follower.name) or {}
        return view.get("leader") == leader.node_id

    await wait_for(swarm, [follower], follower_knows_the_leader, 20.0, "a leader")
    async with httpx.AsyncClient(timeout=15) as client:
        # To the leader, and through a follower (which relays the leader's answer).
        assert_refused(await report_demand(client, leader, INVENTED))
        assert_refused(await report_demand(client, follower, INVENTED))
        # A model in a member's store is demand.
        accepted = await report_demand(client, follower, KNOWN)
        assert accepted.status_code == 200 and accepted.json()["accepted"], accepted.text
        index = accepted.json()["index"]

        def applied(views: dict[str, Any]) -> bool:
            return all(
                (view or {}).get("ledger_applied_index", 0) >= index for view in views.values()
            )

        # The follower is not eligible, so it follows the ledger outside
        # Raft: a commit that names no assignment of its own reaches it by
        # a lazy pull (`LAZY_PULL_S`), after the leader's notice spreads.
        await wait_for(swarm, [leader, follower], applied, LAZY_PULL_S + 20.0, "the demand applied")
        views = await swarm.views([leader, follower])
    for view in views.values():
        assert view is not None and set(view["demand"]) == {KNOWN}
    assert views[leader.name]["drops"].get("placement.unknown_model") == 2  # type: ignore[index]
