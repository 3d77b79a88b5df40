"""Raft in real `shardmesh node` processes on loopback: election, failover
after SIGKILL, catch-up from the sqlite store, a node cut off from the
majority, and kill -9 of the whole cluster under load.

Entries are demand records (`POST /v1/network/demand`), each for a model
name used once, so "is every acknowledged entry still there" is a set
comparison against the ledger's demand table in `/v1/network/status`.
"""

from __future__ import annotations

import itertools
import json
import signal
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from tests.swarm_helpers import (
    START_TIMEOUT_S,
    assert_no_internal_errors,
    start_swarm,
    wait_for,
)

ELECT_TIMEOUT_S = 30.0
"""Covers voter promotion (the local profile's 2 s stabilization, one
configuration change at a time) on a loaded 2-core machine."""
FAILOVER_TIMEOUT_S = 15.0
DEMAND_PATH = "/v1/network/demand"


def leader_of(views: Views, nodes: Sequence[LocalNode]) -> LocalNode | None:
    """The node every answering observer names as leader, if that node
    itself answers and says it leads; None while they disagree."""
    named = {(view or {}).get("leader") for view in views.values() if view is not None}
    if len(named) != 1:
        return None
    (leader_id,) = named
    for node in nodes:
        view = views.get(node.name)
        if node.node_id == leader_id and view is not None and view["raft"]["role"] == "leader":
            return node
    return None


def voters_are(count: int, nodes: Sequence[LocalNode]) -> Callable[[Views], bool]:
    """A leader is agreed on and every answering node holds a configuration
    of `count` voters. The leader's view alone is not enough: it takes a
    configuration on appending it, and a test that cuts the leader off
    before the last promotion reached the others leaves a side whose nodes
    are still learners, which rightly cannot elect anyone."""

    def check(views: Views) -> bool:
        answering = [view for view in views.values() if view is not None]
        return leader_of(views, nodes) is not None and all(
            len(view["raft"]["voters"]) == count for view in answering
        )

    return check


def demand_holds(nodes: Sequence[LocalNode], models: set[str]) -> Callable[[Views], bool]:
    def check(views: Views) -> bool:
        return all(
            views.get(n.name) is not None and models <= set(views[n.name]["demand"]) for n in nodes
        )

    return check


async def propose(client: httpx.AsyncClient, node: LocalNode, model: str) -> httpx.Response:
    """Demand for `model`, reported to `node` as its own chat entry would:
    signed with its key (an unsigned report is refused)."""
    body = json.dumps({"model": model}).encode()
    headers = node.signed_headers(DEMAND_PATH, body)
    return await client.post(node.api + DEMAND_PATH, content=body, headers=headers)


async def propose_until_committed(
    client: httpx.AsyncClient, nodes: Sequence[LocalNode], model: str, timeout: float
) -> dict[str, Any]:
    """Offer `model` to each node in turn until one commits it (through
    forwarding if it is not the leader); the commit's index and term."""
    with trio.fail_after(timeout):
        for node in itertools.cycle(nodes):
            try:
                response = await propose(client, node, model)
            except httpx.HTTPError:
                response = None
            if response is not None and response.status_code == 200:
                return response.json()
            await trio.sleep(0.05)
    raise AssertionError("unreachable")


async def elected(swarm: LocalSwarm, nodes: Sequence[LocalNode], voters: int) -> LocalNode:
    """The leader named in the very views that satisfied the wait: a second
    read could land in an election (they happen on a loaded machine)."""
    agreed = voters_are(voters, nodes)
    seen: list[LocalNode] = []

    def check(views: Views) -> bool:
        leader = leader_of(views, nodes)
        if leader is None or not agreed(views):
            return False
        seen.append(leader)
        return True

    await wait_for(swarm, nodes, check, ELECT_TIMEOUT_S, f"{voters} voters")
    return seen[-1]


@pytest.mark.slow
async def test_five_nodes_elect_fail_over_and_the_old_leader_catches_up(
    swarm: LocalSwarm,
) -> None:
    nodes = await start_swarm(swarm, 5)
    leader = await elected(swarm, nodes, 5)

    async with httpx.AsyncClient(timeout=10) as client:
        # Through a follower: it forwards to the leader and relays the commit.
        before = {f"before-{i}" for i in range(10)}
        via = next(n for n in nodes if n is not leader)
        committed_by: set[str] = set()
        for model in sorted(before):
            # Retried on a retryable 503 (an election on a loaded machine
            # can supersede a proposal); each ends acknowledged.
            commit = await propose_until_committed(client, [via], model, 20.0)
            committed_by.add(commit["leader"])
        # Forwarded to another node's leadership at least once (an election
        # may make `via` itself the leader for the later ones).
        assert committed_by - {via.node_id}
        await wait_for(swarm, nodes, demand_holds(nodes, before), 10.0, "replicated")
        # Leadership may have moved on a loaded machine: kill whoever leads now.
        leader = await elected(swarm, nodes, 5)
        followers = [n for n in nodes if n is not leader]
        old_term = (await swarm.status(leader))["term"]

        leader.kill()
        await leader.wait_exit(5)
        await wait_for(
            swarm,
            followers,
            lambda views: (
                (new := leader_of(views, followers)) is not None
                and views[new.name]["term"] > old_term
            ),
            FAILOVER_TIMEOUT_S,
            "a new leader",
        )
        commit = await propose_until_committed(client, followers, "after-failover", 10.0)
        assert commit["term"] > old_term
        after = before | {"after-failover"}
        await wait_for(swarm, followers, demand_holds(followers, after), 10.0, "survivors")

        # The old leader restarts from its sqlite store and catches up.
        await swarm.start_ready(leader, [followers[0].seed], timeout=START_TIMEOUT_S)
        await wait_for(swarm, [leader], demand_holds([leader], after), 20.0, "catch-up")
        view = await swarm.status(leader)
        assert view is not None and view["leader"] != leader.node_id
        assert view["term"] > old_term
    await assert_no_internal_errors(swarm, nodes)


@pytest.mark.slow
async def test_a_node_cut_off_from_the_majority_cannot_commit_and_has_no_leader(
    swarm: LocalSwarm,
) -> None:
    nodes = await start_swarm(swarm, 3)
    leader = await elected(swarm, nodes, 3)
    rest = [n for n in nodes if n is not leader]

    async def isolate(node: LocalNode, on: bool) -> None:
        response = await client.post(
            node.api + "/v1/debug/faults", json={"isolate": on}, headers=node.admin_headers()
        )
        assert response.status_code == 200 and response.json() == {"isolated": on}

    def has_no_leader(node: LocalNode) -> Callable[[Views], bool]:
        return lambda views: views[node.name] is not None and views[node.name]["leader"] is None

    async with httpx.AsyncClient(timeout=10) as client:
        # The leader itself is cut off: CheckQuorum makes it step down.
        await isolate(leader, True)
        await wait_for(swarm, [leader], has_no_leader(leader), 10.0, "stale leader steps down")
        refused = await propose(client, leader, "never")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_leader"
        assert refused.headers["retry-after"]
        # The majority side elects a leader of its own and commits.
        commit = await propose_until_committed(client, rest, "majority", 15.0)
        await isolate(leader, False)
        await wait_for(swarm, nodes, demand_holds(nodes, {"majority"}), 15.0, "healed")

        # The majority's own leader committed it (the commit names it). "healed"
        # waited on the demand table only: agreeing on a leader again is a
        # separate condition, and leadership may have moved since the commit.
        assert commit["leader"] != leader.node_id
        new_leader = await elected(swarm, nodes, 3)
        assert (await swarm.status(new_leader))["term"] >= commit["term"]  # terms only grow

        # A cut-off follower loses its leader too, and cannot commit through it.
        follower = next(n for n in nodes if n is not new_leader)
        await isolate(follower, True)
        await wait_for(swarm, [follower], has_no_leader(follower), 10.0, "follower sees no leader")
        refused = await propose(client, follower, "never")
        assert refused.status_code == 503
        await isolate(follower, False)
        views = await swarm.views(nodes)
        assert all("never" not in view["demand"] for view in views.values() if view)
    await assert_no_internal_errors(swarm, nodes)


@pytest.mark.slow
async def test_kill_9_under_heavy_proposals_loses_no_acknowledged_entry(
    swarm: LocalSwarm,
) -> None:
    nodes = await start_swarm(swarm, 3)
    leader = await elected(swarm, nodes, 3)
    acknowledged: set[str] = set()

    async def load(client: httpx.AsyncClient, worker: int) -> None:
        # Mostly straight to the leader (the heavy part), some forwarded.
        for i in itertools.count():
            model = f"w{worker}-{i}"
            target = nodes[i % len(nodes)] if worker == 0 else leader
            try:
                response = await propose(client, target, model)
            except httpx.HTTPError:
                return  # the node died mid-request: unacknowledged
            if response.status_code == 200:
                acknowledged.add(model)

    async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as nursery:
        for worker in range(6):
            nursery.start_soon(load, client, worker)
        with trio.fail_after(30):
            while len(acknowledged) < 150:
                await trio.sleep(0.02)
        for node in nodes:  # the whole cluster at once, mid-load
            node.signal(signal.SIGKILL)
        for node in nodes:
            await node.wait_exit(5)
        nursery.cancel_scope.cancel()
    assert len(acknowledged) >= 150

    await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
    await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=START_TIMEOUT_S)
    await wait_for(swarm, nodes, demand_holds(nodes, acknowledged), 30.0, "all acknowledged")
    await assert_no_internal_errors(swarm, nodes)
