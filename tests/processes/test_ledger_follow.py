"""Members outside Raft follow the ledger, in real node processes on loopback.

Nobody but the founder is eligible, so Raft is the founder alone (no
learners: the configuration stays one entry however many join), and the two
other members learn every commit from the leader's notice in its record,
pulling the ledger from it. Once that founder dies, they name it no more
and say what to do (`runtime/node/leadership.py`).
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from runtime.cli.localswarm import LocalSwarm, Views
from tests.swarm_helpers import start_swarm, wait_for

FOLLOW_TIMEOUT_S = 30.0
"""A gossip spread, the notice interval, the lazy pull period and a pull,
on a loaded machine."""


def ledger_nodes(view: dict[str, Any] | None) -> set[str]:
    return {entry["node_id"] for entry in (view or {}).get("ledger", [])}


async def test_members_outside_raft_follow_the_ledger_by_the_leaders_notice(
    swarm: LocalSwarm,
) -> None:
    founder, *members = await start_swarm(swarm, 3, eligible=False)
    nodes = [founder, *members]
    view = await swarm.status(founder)
    assert view is not None
    assert view["raft"]["voters"] == [founder.node_id] and view["raft"]["learners"] == []

    # A bootstrap assignment of the first member (the notice names it: it
    # pulls at once) and one of a node nobody runs (the other pulls lazily).
    assigned = {members[0].node_id, os.urandom(32).hex()}
    async with httpx.AsyncClient(timeout=15) as client:
        for node_id in sorted(assigned):
            answer = await client.post(
                founder.api + "/v1/nodes/assign",
                json={"node_id": node_id, "model": "m", "layers": [0, 1], "recipe": "fp32"},
                headers={**founder.admin_headers(), "content-type": "application/json"},
            )
            assert answer.status_code == 200 and answer.json()["accepted"], answer.text
    index = answer.json()["index"]

    def followed(views: Views) -> bool:
        return (
            all(
                (v := views.get(m.name)) is not None
                and assigned <= ledger_nodes(v)
                and v["ledger_applied_index"] >= index
                for m in members
            )
            and notice_seen(views) >= index
        )

    def notice_seen(views: Views) -> int:
        """The index of the leader's notice as the first member's gossip holds
        it: a member may pull the ledger past it before the record that
        names the last commit has spread (at most one notice interval)."""
        for member in (views.get(members[0].name) or {}).get("members", []):
            if member["node_id"] == founder.node_id:
                return int((member.get("record") or {}).get("ledger", {}).get("index", -1))
        return -1

    await wait_for(swarm, nodes, followed, FOLLOW_TIMEOUT_S, "the commit followed by members")
    views = await swarm.views(nodes)
    for member in members:
        view = views[member.name]
        assert view is not None
        follower = view["ledger_follower"]
        assert follower["following"] and follower["pulls"] >= 1, follower
        assert follower["trusted"] == [founder.node_id]  # the voters its pull named
        assert view["raft"]["voters"] == [] and view["raft"]["learners"] == []  # not in Raft
        assert view["swarm"]["id"] == founder.node_id  # the founding, followed too
        assert view["leader"] == founder.node_id  # known by its notice
    assert views[founder.name]["ledger_follower"]["following"] is False
    leader_record = next(
        m for m in views[members[0].name]["members"] if m["node_id"] == founder.node_id
    )
    notice = leader_record["record"]["ledger"]
    assert notice["index"] >= index  # the notice, gossiped
    assert {node for node, _ in notice["changed"]} >= assigned  # naming whom it concerns


LOST_TIMEOUT_S = 30.0
"""Membership declaring a killed node dead on the local profile (seconds),
on a loaded machine."""


async def test_members_stop_naming_a_founder_that_died_and_say_how_to_recover(
    swarm: LocalSwarm,
) -> None:
    """Issue 30, item 8: the founder was the only voter; once it is dead the
    members that cannot vote name no leader and say why and what to run."""
    founder, *members = await start_swarm(swarm, 3, eligible=False)
    await wait_for(
        swarm,
        members,
        lambda views: all(
            (views.get(m.name) or {}).get("leader") == founder.node_id for m in members
        ),
        FOLLOW_TIMEOUT_S,
        "the founder named by its notice",
    )
    founder.kill()

    def lost(views: Views) -> bool:
        return all(
            (v := views.get(m.name)) is not None
            and v["leader"] is None
            and v["leadership"]["lost"] == founder.node_id
            for m in members
        )

    await wait_for(swarm, members, lost, LOST_TIMEOUT_S, "the dead founder named no more")
    view = await swarm.status(members[0])
    assert view is not None
    leadership = view["leadership"]
    assert leadership["state"] == "leaderless" and "was declared dead" in leadership["why"]
    assert f"restart {founder.node_id[:12]} with its own --state-dir" in leadership["fix"]
