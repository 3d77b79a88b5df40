"""The membership driver: two real drivers on loopback join, gossip a record, leave.

Consensus payloads ride the same plane, signed: the receiver hands them to
Raft only from the sender that signed them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from mesh.config import MembershipConfig
from mesh.identity import Identity
from mesh.membership import MemberView
from mesh.records import Addresses, NodeRecord, encode_record_body
from mesh.transport import open_planes
from runtime.node.membership_driver import MembershipDriver
from runtime.node.state_dir import StateDir

LOOPBACK = "tcp://127.0.0.1:0"


@asynccontextmanager
async def driver(where: Path, inbox: list[tuple[bytes, bytes]]) -> AsyncIterator[MembershipDriver]:
    identity = Identity.generate()
    where.mkdir()
    async with open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=identity.plane_keys()) as (
        control,
        _data,
    ):
        with StateDir(where) as state:
            yield MembershipDriver(
                identity=identity,
                state=state,
                config=MembershipConfig.profile("local"),
                plane=control,
                address=control.address,
                incarnation=state.next_incarnation(),
                on_consensus=lambda sender, payload: inbox.append((sender, payload)),
            )


def view_of(driver: MembershipDriver, node: bytes) -> MemberView | None:
    return next((view for view in driver.core.members() if view.node == node), None)


async def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


async def test_two_drivers_join_gossip_records_and_consensus(tmp_path: Path) -> None:
    to_a: list[tuple[bytes, bytes]] = []
    to_b: list[tuple[bytes, bytes]] = []
    async with (
        driver(tmp_path / "a", to_a) as a,
        driver(tmp_path / "b", to_b) as b,
        trio.open_nursery() as nursery,
    ):
        assert a.join_status()["state"] == "founded", "no seeds: this node founds the swarm"
        assert a.twin_addr is None
        nursery.start_soon(a.run)
        nursery.start_soon(b.run)
        b.join([(a.node_id, a.address)])
        await until(lambda: b.join_status()["state"] == "joined")
        await until(lambda: any(node == b.node_id for node, _, _ in a.peer_states()))

        record = NodeRecord(addresses=Addresses(b.address, "tcp://127.0.0.1:2"), started_at=1.0)
        b.publish_record(encode_record_body(record))
        await until(lambda: view_of(a, b.node_id) is not None)
        await until(lambda: getattr(view_of(a, b.node_id), "record", None) is not None)

        b.send_consensus(a.node_id, b"append entries")
        await until(lambda: bool(to_a))
        assert to_a == [(b.node_id, b"append entries")], "the signed sender, verified"
        assert set(a.drops()) == {"wire", "membership", "node"}

        await b.leave()
        assert b.leaving
        await until(lambda: str(getattr(view_of(a, b.node_id), "state", "")) in ("left", "dead"))
        nursery.cancel_scope.cancel()
