"""Raft in real `shardmesh node` processes on loopback: election, failover
after SIGKILL, catch-up from the sqlite store, a node cut off from the
majority, and kill -9 of the whole cluster under load.

Entries are bootstrap assignments (`POST /v1/nodes/assign`, with the asked
node's operator token) of fresh random node ids, each used once, so "is
every acknowledged entry still there" is a set comparison against the node
ids of the `"ledger"` in `/v1/network/status`. A follower forwards such a
call to the leader signed by itself, and the leader takes it only from a
Raft voter: every test waits until all its nodes are voters before it
proposes anything.
"""

from __future__ import annotations

import itertools
import os
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
ASSIGN_PATH = "/v1/nodes/assign"


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


def fresh_id() -> str:
    """A node id nobody holds: its bootstrap assignment is a new entry."""
    return os.urandom(32).hex()


def assigned(view: dict[str, Any]) -> set[str]:
    """The node ids the ledger holds an assignment for, in one status view."""
    return {entry["node_id"] for entry in view["ledger"]}


def ledger_holds(nodes: Sequence[LocalNode], ids: set[str]) -> Callable[[Views], bool]:
    def check(views: Views) -> bool:
        return all((view := views.get(n.name)) is not None and ids <= assigned(view) for n in nodes)

    return check


async def propose(client: httpx.AsyncClient, node: LocalNode, node_id: str) -> httpx.Response:
    """A bootstrap assignment of `node_id`, asked of `node` by its operator:
    it commits it if it leads, else forwards it to the leader signed by
    itself (which the leader takes only from a voter)."""
    body = {"node_id": node_id, "model": "m", "layers": [0, 1], "recipe": "fp32"}
    headers = {**node.admin_headers(), "content-type": "application/json"}
    return await client.post(node.api + ASSIGN_PATH, json=body, headers=headers)


def already_committed(response: httpx.Response) -> bool:
    """The id was committed before this request (an earlier try whose
    answer was lost): a 409 `already_assigned`, or a 200 whose entry the
    ledger rejected as a stale epoch of the same node."""
    if response.status_code == 409:
        return bool(response.json()["error"]["code"] == "already_assigned")
    return response.status_code == 200 and not response.json()["accepted"]


async def propose_until_committed(
    client: httpx.AsyncClient, nodes: Sequence[LocalNode], timeout: float
) -> tuple[str, dict[str, Any]]:
    """Offer a fresh id to each node in turn until one acknowledges its
    commit (through forwarding if it is not the leader): that id, and the
    commit's index, term and leader. A retryable failure (a 503 in an
    election, a dropped connection) retries the same id; an id that turns
    out to have been committed by a try whose answer was lost is dropped
    for a new one, so the id returned is one whose own commit was seen."""
    node_id = fresh_id()
    with trio.fail_after(timeout):
        for node in itertools.cycle(nodes):
            try:
                response = await propose(client, node, node_id)
            except httpx.HTTPError:
                response = None
            if response is not None and already_committed(response):
                node_id = fresh_id()
            elif response is not None and response.status_code == 200:
                return node_id, response.json()
            elif response is not None and response.status_code != 503:
                raise AssertionError(f"{response.status_code} {response.text}")
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
        via = next(n for n in nodes if n is not leader)
        before: set[str] = set()
        committed_by: set[str] = set()
        for _ in range(10):
            # Retried on a retryable 503 (an election on a loaded machine
            # can supersede a proposal); each ends acknowledged.
            node_id, commit = await propose_until_committed(client, [via], 20.0)
            before.add(node_id)
            committed_by.add(commit["leader"])
        assert len(before) == 10
        # Forwarded to another node's leadership at least once (an election
        # may make `via` itself the leader for the later ones).
        assert committed_by - {via.node_id}
        await wait_for(swarm, nodes, ledger_holds(nodes, before), 10.0, "replicated")
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
        after_failover, commit = await propose_until_committed(client, followers, 10.0)
        assert commit["term"] > old_term
        after = before | {after_failover}
        await wait_for(swarm, followers, ledger_holds(followers, after), 10.0, "survivors")

        # The old leader restarts from its sqlite store and catches up.
        await swarm.start_ready(leader, [followers[0].seed], timeout=START_TIMEOUT_S)
        await wait_for(swarm, [leader], ledger_holds([leader], after), 20.0, "catch-up")
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

    never = fresh_id()
    async with httpx.AsyncClient(timeout=10) as client:
        # The leader itself is cut off: CheckQuorum makes it step down.
        await isolate(leader, True)
        await wait_for(swarm, [leader], has_no_leader(leader), 10.0, "stale leader steps down")
        refused = await propose(client, leader, never)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_leader"
        assert refused.headers["retry-after"]
        # The majority side elects a leader of its own and commits.
        majority, commit = await propose_until_committed(client, rest, 15.0)
        await isolate(leader, False)
        await wait_for(swarm, nodes, ledger_holds(nodes, {majority}), 15.0, "healed")

        # The majority's own leader committed it (the commit names it). "healed"
        # waited on the ledger only: agreeing on a leader again is a
        # separate condition, and leadership may have moved since the commit.
        assert commit["leader"] != leader.node_id
        new_leader = await elected(swarm, nodes, 3)
        assert (await swarm.status(new_leader))["term"] >= commit["term"]  # terms only grow

        # A cut-off follower loses its leader too, and cannot commit through it.
        follower = next(n for n in nodes if n is not new_leader)
        await isolate(follower, True)
        await wait_for(swarm, [follower], has_no_leader(follower), 10.0, "follower sees no leader")
        refused = await propose(client, follower, never)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_leader"
        await isolate(follower, False)
        views = await swarm.views(nodes)
        assert all(never not in assigned(view) for view in views.values() if view)
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
            node_id = fresh_id()
            target = nodes[i % len(nodes)] if worker == 0 else leader
            try:
                response = await propose(client, target, node_id)
            except httpx.HTTPError:
                return  # the node died mid-request: unacknowledged
            if response.status_code == 200:
                assert response.json()["accepted"], response.text  # a fresh id: never stale
                acknowledged.add(node_id)
            else:  # only a retryable refusal (an election), never a 403 or a 4xx
                assert response.status_code == 503, response.text

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
    await wait_for(swarm, nodes, ledger_holds(nodes, acknowledged), 30.0, "all acknowledged")
    await assert_no_internal_errors(swarm, nodes)
