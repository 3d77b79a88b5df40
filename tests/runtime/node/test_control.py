"""The control side, wired: real planes on loopback, a real sqlite Raft store."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from consensus.storage import RaftStorage
from mesh.identity import Identity
from mesh.transport import open_planes
from runtime.node.control import wire_control
from runtime.node.state_dir import StateDir

LOOPBACK = "tcp://127.0.0.1:0"


async def test_the_drivers_are_tied_to_each_other(tmp_path: Path) -> None:
    identity = Identity.generate()
    seed = Identity.generate().node_id
    with StateDir(tmp_path) as state, RaftStorage.open(tmp_path / "raft.sqlite3") as storage:
        async with open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=identity.plane_keys()) as (
            control,
            _data,
        ):
            wired = wire_control(
                identity=identity,
                state=state,
                profile="local",
                plane=control,
                address=control.address,
                incarnation=0,
                storage=storage,
                seeds=[(seed, "tcp://127.0.0.1:9")],
                encrypted=True,
                on_reach_change=lambda: None,
            )
            delivered: list[tuple[bytes, bytes]] = []
            wired.raft.deliver = lambda sender, payload: delivered.append((sender, payload))  # type: ignore[method-assign]
            membership: Any = wired.membership
            membership._on_consensus(seed, b"raft bytes")
            assert delivered == [(seed, b"raft bytes")], "membership hands Raft payloads to Raft"
            assert wired.membership.node_id == wired.raft.node_id == identity.node_id
            assert wired.swarm.node_id == identity.node_id
            assert wired.raft.followed_leader == wired.follower.leader
            assert wired.raft.followed_leader() is None, "no leader followed yet"
            assert wired.raft.member_of == wired.membership.member_state
            assert wired.raft.member_of(seed) is None, "a seed it has not reached is no member"
            follower: Any = wired.follower
            assert follower._seeds == (seed,), "a joiner trusts its seeds first"
            assert wired.swarm.record(identity.node_id) is None, "nothing published yet"
            assert wired.reachability.reach == "unknown", "nobody asked to dial back yet"


async def test_a_founder_bootstraps_raft_and_a_joiner_does_not(tmp_path: Path) -> None:
    for seeds, bootstraps in (([], True), ([Identity.generate().node_id], False)):
        where = tmp_path / str(bootstraps)
        where.mkdir()
        identity = Identity.generate()
        with StateDir(where) as state, RaftStorage.open(where / "raft.sqlite3") as storage:
            async with open_planes(
                LOOPBACK, LOOPBACK, drops=Counter(), keys=identity.plane_keys()
            ) as (control, _data):
                wired = wire_control(
                    identity=identity,
                    state=state,
                    profile="local",
                    plane=control,
                    address=control.address,
                    incarnation=0,
                    storage=storage,
                    seeds=[(node, "tcp://127.0.0.1:9") for node in seeds],
                    encrypted=True,
                    on_reach_change=lambda: None,
                )
                raft: Any = wired.raft
                assert raft._write_bootstrap_config is bootstraps
