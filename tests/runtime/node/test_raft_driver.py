"""The Raft driver: a real one-voter cluster on sqlite proposes, applies, persists;
a follower refuses proposals; bad payloads are counted, never raised.

Multi-node elections and failover are in tests/processes/test_consensus.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import trio

from consensus.commands import Found
from consensus.config import ConsensusConfig
from consensus.ledger import ApplyResult
from consensus.storage import RaftStorage
from runtime.node.raft_driver import NotLeader, RaftDriver

ME, OTHER = b"\x01" * 32, b"\x02" * 32


def driver(store: RaftStorage, *, bootstrap: bool) -> RaftDriver:
    return RaftDriver(
        node_id=ME,
        storage=store,
        config=ConsensusConfig.local(),
        bootstrap=bootstrap,
        send=lambda to, payload: None,
        members=lambda: (),
        rng=random.Random(0),
    )


async def test_a_founder_leads_applies_and_keeps_it_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "raft.sqlite3"
    applied: list[ApplyResult] = []
    with RaftStorage.open(path) as store:
        raft = driver(store, bootstrap=True)
        raft.on_apply.append(applied.append)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(raft.run)
            with trio.fail_after(10):
                while not raft.is_leader:
                    await trio.sleep(0.01)
            assert raft.leader() == ME and raft.in_configuration()
            committed = await raft.propose(Found(ME, "private", time.time()))
            assert committed.accepted
            assert raft.ledger.founding is not None and raft.ledger.founding.mode == "private"
            assert [r.index for r in applied if r.accepted][-1] == committed.index
            notice = raft.notice()
            assert notice is not None and notice.index >= committed.index
            nursery.cancel_scope.cancel()
    with RaftStorage.open(path) as store:
        again = driver(store, bootstrap=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(again.run)
            with trio.fail_after(10):
                while again.ledger.founding is None:
                    await trio.sleep(0.01)
            assert again.ledger.founding.mode == "private", "durable before it was acknowledged"
            nursery.cancel_scope.cancel()


async def test_a_joiner_without_a_leader_refuses_proposals(tmp_path: Path) -> None:
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=False)
        assert not raft.is_leader and raft.notice() is None
        with pytest.raises(NotLeader) as caught:
            await raft.propose(Found(ME, "open", time.time()))
        assert caught.value.leader is None


def test_bad_payloads_are_counted_and_dropped(tmp_path: Path) -> None:
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=False)
        raft.deliver(OTHER, b"\xff not raft")
        assert sum(raft.drops.values()) == 1
