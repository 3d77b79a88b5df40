"""Placement in the node: demand counted, refused for unknown models, committed by a
real one-voter Raft driver (sqlite on disk).

The placement policy itself is in tests/consensus/test_placement.py; a
swarm placing shards across processes in tests/processes/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import trio

from consensus.storage import RaftStorage
from mesh.identity import Identity
from runtime.model.store import ModelStore
from runtime.model.tiny import make_tiny_model
from runtime.node.placement_driver import DROP_UNKNOWN_MODEL, Placement
from runtime.node.raft_driver import RaftDriver
from tests.runtime.node.test_raft_driver import driver


class Swarm:
    """The swarm view as placement's demand path reads it."""

    def __init__(self, node_id: bytes, known: set[str]) -> None:
        self.node_id = node_id
        self._known = known

    def known_models(self) -> set[str]:
        return self._known

    def member_api(self, node: bytes) -> str | None:
        return None


def placement(
    raft: RaftDriver, identity: Identity, known: set[str], store: Path | None = None
) -> Placement:
    return Placement(
        raft=raft,
        swarm=cast(Any, Swarm(identity.node_id, known)),
        store=ModelStore.scan(store),
        slot=cast(Any, None),
        backend=None,
        auto_join=False,
        signer=identity,
    )


async def test_demand_for_a_known_model_is_committed_unknown_refused(tmp_path: Path) -> None:
    identity = Identity.generate()
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=True, node_id=identity.node_id)
        desk = placement(raft, identity, known={"m"})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(raft.run)
            with trio.fail_after(10):
                while not raft.is_leader:
                    await trio.sleep(0.01)
            assert desk.demand_refusal("m") is None
            assert "no member stores" in (desk.demand_refusal("invented") or "")
            assert desk.drops[DROP_UNKNOWN_MODEL] == 1
            before = raft.ledger.applied_index
            assert await desk._send_demand("m", 3)
            assert raft.ledger.applied_index > before, "a RecordDemand committed"
            at = raft.ledger.applied_index
            assert await desk._send_demand("invented", 2), "refused for good, not retried"
            assert raft.ledger.applied_index == at and desk.drops[DROP_UNKNOWN_MODEL] == 2
            nursery.cancel_scope.cancel()


async def test_a_follower_with_no_leader_keeps_its_demand_for_the_next_flush(
    tmp_path: Path,
) -> None:
    identity = Identity.generate()
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=False, node_id=identity.node_id)
        desk = placement(raft, identity, known={"m"})
        desk.count_demand("m", unserved=True)
        assert not await desk._send_demand("m", 1), "no leader to take it: kept"
        assert desk.num_layers("m") is None
        assert desk.why_waiting("m")[0]


def test_a_stored_model_is_known_before_any_round_planned_it(tmp_path: Path) -> None:
    """The first request can come before the first placement round that
    wanted the model: its size is read from this node's store, and the
    503 says demand is what it waits for, not that nobody knows the model."""
    make_tiny_model(tmp_path / "store" / "y", layers=8, name="y")
    identity = Identity.generate()
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=False, node_id=identity.node_id)
        desk = placement(raft, identity, known={"y"}, store=tmp_path / "store")
        assert desk.num_layers("y") == 8
        assert desk.why_waiting("y")[0] == "no_demand"
        assert desk.num_layers("nope") is None
        assert desk.why_waiting("nope")[0] == "unknown_model"
