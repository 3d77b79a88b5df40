"""The Raft driver: a real one-voter cluster on sqlite proposes, applies, persists;
a follower refuses proposals; bad payloads are counted, never raised.

Multi-node elections and failover are in tests/processes/test_consensus.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from consensus.commands import Found
from consensus.config import ConsensusConfig
from consensus.ledger import ApplyResult
from consensus.storage import RaftStorage
from runtime.node.leadership import silence_s
from runtime.node.raft_driver import NotLeader, RaftDriver

ME, OTHER = b"\x01" * 32, b"\x02" * 32


def driver(store: RaftStorage, *, bootstrap: bool, node_id: bytes = ME) -> RaftDriver:
    """A lone driver that sends nothing: the founder of its own swarm
    (`bootstrap`), else a follower that knows no leader."""
    return RaftDriver(
        node_id=node_id,
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


LEADER = b"\x03" * 32


async def test_a_member_outside_raft_stops_naming_a_leader_declared_dead(tmp_path: Path) -> None:
    """Issue 30, item 8: the founder (the only voter) died, and every member
    that cannot vote went on naming it, its notice still in the record
    membership keeps for a day."""
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=False)
        raft.followed_leader = lambda: LEADER  # its notice has the highest term heard
        state = {"state": "alive", "since": trio.current_time()}
        raft.member_of = lambda node: (state["state"], state["since"]) if node == LEADER else None
        assert raft.leader() == LEADER
        state["state"] = "dead"
        assert raft.leader() is None, "a leader membership declared dead is named no more"
        status = raft.status()
        assert status["leader"] is None
        leadership = status["leadership"]
        assert leadership["state"] == "leaderless" and leadership["lost"] == LEADER.hex()
        assert "was declared dead" in leadership["why"]
        assert "restart" in leadership["fix"], "no node that may vote is alive"
        state["state"] = "alive"  # it came back (a restart with its state dir)
        assert raft.leader() == LEADER and raft.status()["leadership"]["state"] == "following"


async def test_a_learner_stops_naming_a_leader_it_no_longer_hears(tmp_path: Path) -> None:
    """A learner never campaigns, so its Raft core follows a dead leader for
    ever; the driver stops naming one silent past the bound."""
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=False)
        core: Any = raft.raft
        core._voters, core._learners = frozenset({LEADER, OTHER}), frozenset({ME})
        core._leader = LEADER
        heard: Any = raft._last_contact
        heard[LEADER] = trio.current_time()
        raft.member_of = lambda node: ("alive", 0.0)
        assert raft.in_configuration() and raft.leader() == LEADER
        bound = silence_s(raft.config.tick_s, raft.config.raft.election_ticks)
        heard[LEADER] = trio.current_time() - bound - 1.0
        assert raft.leader() is None
        leadership = raft.status()["leadership"]
        assert "sent no Raft message" in leadership["why"]
        assert (
            "shardmesh voters refound" in leadership["fix"]
            and OTHER.hex()[:12] in leadership["fix"]
        )


async def test_a_voter_without_a_leader_says_so(tmp_path: Path) -> None:
    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        raft = driver(store, bootstrap=True)  # a voter that has not yet elected itself
        leadership = raft.status()["leadership"]
        assert leadership["state"] == "leaderless" and leadership["lost"] is None
        assert leadership["why"].startswith("no leader for")
