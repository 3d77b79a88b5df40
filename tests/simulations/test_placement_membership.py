"""What a placement simulation's voters and entries know of who is alive:
the oracle's fixed delay, SWIM members numbered voters-workers-entries, the
leader's node views, and a voter partition split onto the SWIM network."""

from __future__ import annotations

import pytest

from consensus.commands import Assign, encode_command
from consensus.ledger import PlacementLedger
from consensus.placement import ModelFacts
from mesh.config import MembershipConfig
from mesh.records import Assignment
from simulations.loop import EventLoop
from simulations.placement_membership import DETECT_S, Membership
from simulations.placement_trace import Trace
from simulations.placement_workers import GB, Fleet, WorkerSpec

MODELS = {"y": ModelFacts(32, GB // 2)}
SHARD = Assignment("y", (0, 32), "bf16", "managed", True, 1)
VOTERS, ENTRIES = 3, 2


def build(swim: bool, workers: int = 2) -> tuple[Membership, Fleet, EventLoop]:
    loop = EventLoop()
    fleet = Fleet([WorkerSpec(24, ("y",)) for _ in range(workers)], MODELS, Trace(loop))
    config = MembershipConfig.lan() if swim else None
    return Membership(1, fleet, VOTERS, ENTRIES, loop, config=config), fleet, loop


def test_the_oracle_holds_a_crashed_worker_dead_detect_s_after_the_crash() -> None:
    membership, fleet, loop = build(swim=False)
    worker = fleet.workers[0]
    assert membership.seen(0, worker) == ("alive", 0.0)
    loop.run_until(5.0)
    fleet.crash(0, now=5.0)
    loop.run_until(5.0 + DETECT_S - 0.1)
    assert membership.seen(1, worker) == ("alive", 5.0)
    loop.run_until(5.0 + DETECT_S)
    assert membership.seen(1, worker) == ("dead", 5.0 + DETECT_S)
    assert membership.swim is None and membership.entry_member(0) is None


def test_views_claim_the_doctor_verdict_only_for_the_shard_the_ledger_holds() -> None:
    membership, fleet, _ = build(swim=False)
    ledger = PlacementLedger()
    first, second = fleet.workers
    command = Assign(first.node, "y", (0, 32), "bf16", "managed", True, 1, 0.0)
    assert ledger.apply(1, encode_command(command)).accepted
    for worker in (first, second):
        worker.serving, worker.verdict = SHARD, "admitted"
    views = membership.views(ledger, 0)
    assert views[first.node].capability == "admitted"
    assert views[second.node].capability == "none"  # serving what the ledger never gave it
    assert views[first.node].memory_bytes == 24 * GB and views[first.node].spare
    assert views[first.node].models == frozenset({"y"})


def test_announced_lists_serving_workers_with_liveness_and_doctor_failure() -> None:
    membership, fleet, _ = build(swim=False)
    first, second = fleet.workers
    first.serving, first.verdict = SHARD, "failed"
    announced = membership.announced(0)
    assert set(announced) == {first.node}
    assert announced[first.node].live and announced[first.node].failure == "doctor failed"
    assert second.node not in announced


def test_cutting_workers_off_needs_swim_and_a_split_without_it_is_nothing() -> None:
    membership, _, _ = build(swim=False)
    with pytest.raises(ValueError, match="SWIM"):
        membership.check_cut_off([1])
    membership.check_cut_off([])
    membership.split([[0], [1, 2]], (), 1.0, 2.0)  # no network to split


def test_swim_members_are_the_voters_then_the_workers_then_the_entries() -> None:
    membership, fleet, _ = build(swim=True)
    assert membership.swim is not None
    assert [membership.members[w.node] for w in fleet.workers] == [3, 4]
    assert membership.entry_members == [5, 6]
    assert [membership.entry_member(i) for i in range(ENTRIES)] == [5, 6]
    assert membership.member_view(0, fleet.workers[1])[0] == "alive"


def test_a_voter_split_puts_workers_and_entries_with_the_largest_side() -> None:
    membership, fleet, loop = build(swim=True, workers=3)
    assert membership.swim is not None
    membership.split([[0], [1, 2]], [2], at=1.0, heal=5.0)
    loop.run_until(2.0)
    network = membership.swim.network
    entry, cut_off = membership.entry_members[0], membership.members[fleet.workers[2].node]
    worker = membership.members[fleet.workers[0].node]
    assert network.can_reach(1, worker) and network.can_reach(entry, worker)
    assert not network.can_reach(0, worker) and not network.can_reach(0, 1)
    assert not any(network.can_reach(cut_off, m) for m in (0, 1, worker, entry))
    loop.run_until(6.0)
    assert network.can_reach(0, worker) and network.can_reach(cut_off, entry)


def test_the_leader_notes_when_its_own_core_holds_a_crashed_worker_dead() -> None:
    membership, fleet, loop = build(swim=True)
    loop.run_until(5.0)
    membership.crashed(0)
    fleet.crash(0, now=5.0)
    membership.crash(0, at=5.0)
    assert fleet.workers[0].gossiped is not None  # its last record stays with the members
    assert [(d.worker, d.crashed_at, d.leader_dead_at) for d in membership.detections] == [
        (0, 5.0, None)
    ]
    while membership.detections[0].leader_dead_at is None and loop.now < 60.0:
        loop.run_until(loop.now + 0.25)
        membership.watch_leader(0, 0.25)
    dead_at = membership.detections[0].leader_dead_at
    assert dead_at is not None and 5.0 < dead_at <= loop.now
    summary = membership.summary(rerouted=3)
    assert summary["rerouted"] == 3 and summary["false_dead"] == 0
    assert summary["detections"] == [
        {"worker": 0, "crashed_at": 5.0, "leader_dead_at": dead_at,
         "detect_s": round(dead_at - 5.0, 6)}
    ]  # fmt: skip
    assert summary["live_held_dead_s"] == 0.0  # worker 1 ran throughout, held alive
