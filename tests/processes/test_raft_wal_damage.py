"""A follower killed with SIGKILL whose WAL is then cut short, in real processes.

The node must say so when it starts (naming its store, its marker and the
indexes), report the repair in `/v1/network/status`, be caught up by the
leader and then take part normally: a damaged store is never a silent reset.
"""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from consensus.storage import marker_path
from runtime.cli.localswarm import LocalSwarm, Views
from runtime.node.daemon import RAFT_STORE
from tests.processes.test_consensus import elected, ledger_holds, propose_until_committed
from tests.swarm_helpers import START_TIMEOUT_S, assert_no_internal_errors, start_swarm, wait_for

WAL_HEADER = 32
"""Cutting the WAL to its header drops every frame since the last checkpoint."""


@pytest.mark.slow
async def test_follower_with_a_cut_wal_says_so_is_repaired_and_votes_again(
    swarm: LocalSwarm,
) -> None:
    nodes = await start_swarm(swarm, 3)
    leader = await elected(swarm, nodes, 3)
    async with httpx.AsyncClient(timeout=10) as client:
        acknowledged = set()
        for _ in range(3):
            node_id, _ = await propose_until_committed(client, [leader, *nodes], 20.0)
            acknowledged.add(node_id)
        await wait_for(swarm, nodes, ledger_holds(nodes, acknowledged), 15.0, "replicated")

        leader = await elected(swarm, nodes, 3)
        follower = next(n for n in nodes if n is not leader)
        before = await swarm.status(follower)
        assert before is not None and before["raft"]["repairing_until"] is None
        acknowledged_through = before["raft"]["last_index"]
        follower.signal(signal.SIGKILL)
        await follower.wait_exit(5)
        store = follower.state_dir / RAFT_STORE
        wal = store.with_name(f"{store.name}-wal")
        assert wal.stat().st_size > WAL_HEADER
        with wal.open("r+b") as f:
            f.truncate(WAL_HEADER)

        await swarm.start_ready(follower, [leader.seed], timeout=START_TIMEOUT_S)
        text = follower.log_path.read_text(errors="replace")
        (line,) = [x for x in text.splitlines() if "is behind its marker" in x]
        assert str(store) in line and str(marker_path(store)) in line
        found = re.search(r"entries through index (\d+) .* now ends at index (\d+) ", line)
        assert found is not None, line
        assert int(found[1]) >= acknowledged_through > int(found[2])

        def repaired(views: Views) -> bool:
            view = views.get(follower.name)
            return (
                view is not None
                and view["raft"]["repairing_until"] is None
                and view["raft"]["last_index"] >= acknowledged_through
            )

        await wait_for(swarm, [follower], repaired, 20.0, "repaired by the leader")
        await wait_for(swarm, [follower], ledger_holds([follower], acknowledged), 10.0, "ledger")

        # It takes part normally again: with the old leader gone, it and the
        # third node elect a leader between them (its vote is needed).
        leader.kill()
        await leader.wait_exit(5)
        rest = [n for n in nodes if n is not leader]
        node_id, commit = await propose_until_committed(client, rest, 30.0)
        assert commit["leader"] != leader.node_id
        await wait_for(swarm, rest, ledger_holds(rest, acknowledged | {node_id}), 10.0, "after")
    await assert_no_internal_errors(swarm, rest)
