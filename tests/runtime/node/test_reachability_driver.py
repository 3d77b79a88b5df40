"""The reachability driver on loopback: real planes, membership drivers and dial-backs.

Two nodes in one trio run, each with its real control plane (CURVE) and
membership driver: a node whose record advertises the address it listens
on learns `direct`; one whose record advertises an address nobody answers
on (what a home router's private address is to the internet) learns it is
unreachable. A prober dials only the address in the requester's signed
record, whatever the envelope claims, and serves one requester at a
bounded rate.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from mesh import records
from mesh.config import MembershipConfig
from mesh.identity import Identity
from mesh.messages import DialBack, DialRequest, Envelope
from mesh.transport import Plane, open_plane
from mesh.wire import encode_envelope
from runtime.node.membership_driver import MembershipDriver
from runtime.node.reachability_driver import (
    FIRST_CHECK_S,
    MAX_DIALS,
    ReachabilityDriver,
    dial_once,
    reachability_text,
)
from runtime.node.state_dir import StateDir

LOOPBACK = "tcp://127.0.0.1:0"


def closed_port_address() -> str:
    """A loopback address nothing listens on: a dial to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


class Node:
    def __init__(self, membership: MembershipDriver, reach: ReachabilityDriver, plane: Plane):
        self.membership = membership
        self.reach = reach
        self.plane = plane
        self.republished = 0


def record_of(membership: MembershipDriver) -> Callable[[bytes], records.NodeRecord | None]:
    """The record `node` signed, member or not (`SwarmView.signed_record`):
    a node nobody can dial never answers a ping, so it is never a member."""

    def lookup(node: bytes) -> records.NodeRecord | None:
        record = membership.core.record(node)
        return None if record is None else records.decode_record_body(record.body)

    return lookup


@asynccontextmanager
async def node(
    where: Path, *, advertise: str | None = None, seeds: list[tuple[bytes, str]] | None = None
) -> AsyncIterator[Node]:
    identity = Identity.generate()
    where.mkdir()
    keys = identity.plane_keys()
    async with open_plane(
        LOOPBACK, name="control", max_message_bytes=1 << 22, drops=Counter(), keys=keys
    ) as plane:
        with StateDir(where) as state:
            address = advertise or plane.address
            membership = MembershipDriver(
                identity=identity,
                state=state,
                config=MembershipConfig.profile("local"),
                plane=plane,
                address=address,
                incarnation=state.next_incarnation(),
                on_consensus=lambda sender, payload: None,
            )
            reach = ReachabilityDriver(
                membership=membership,
                keys=keys,
                encrypted=True,
                seeds=seeds or [],
                record_of=record_of(membership),
                on_change=lambda: None,
            )
            built = Node(membership, reach, plane)

            def republish() -> None:
                built.republished += 1
                body = records.NodeRecord(
                    addresses=records.Addresses(address, "tcp://127.0.0.1:9"),
                    started_at=1.0,
                    reach=reach.reach,
                )
                membership.publish_record(records.encode_record_body(body))

            reach._on_change = republish
            republish()
            yield built


async def until(condition: Callable[[], bool], timeout: float) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


async def run_pair(nursery: trio.Nursery, a: Node, b: Node) -> None:
    for one in (a, b):
        nursery.start_soon(one.membership.run)
        nursery.start_soon(one.reach.run)
    b.membership.join([(a.membership.node_id, a.membership.address)])


async def test_two_nodes_on_loopback_learn_they_are_direct(tmp_path: Path) -> None:
    async with (
        node(tmp_path / "a") as a,
        node(tmp_path / "b") as b,
        trio.open_nursery() as nursery,
    ):
        await run_pair(nursery, a, b)
        started = trio.current_time()
        await until(lambda: a.reach.status()["verdict"] == "direct", 10)
        await until(lambda: b.reach.status()["verdict"] == "direct", 10)
        took = trio.current_time() - started
        assert took < FIRST_CHECK_S + 3, f"a loopback check took {took:.1f}s"
        status = b.reach.status()
        assert status["says"] == f"reachable at {b.membership.address}"
        assert status["answers"]["ok"] == 1
        assert b.reach.reach == "direct"
        assert b.republished >= 2, "the verdict is republished in the signed record"
        view = a.membership.member(b.membership.node_id)
        assert view is not None and view.record is not None
        await until(
            lambda: record_of(a.membership)(b.membership.node_id).reach == "direct",  # type: ignore[union-attr]
            5,
        )
        nursery.cancel_scope.cancel()


async def test_a_node_whose_advertised_address_nobody_can_dial_learns_it_is_unreachable(
    tmp_path: Path,
) -> None:
    hidden = closed_port_address()
    async with node(tmp_path / "a") as a:
        seed = [(a.membership.node_id, a.membership.address)]
        async with (
            node(tmp_path / "b", advertise=hidden, seeds=seed) as b,
            trio.open_nursery() as nursery,
        ):
            await run_pair(nursery, a, b)
            await until(lambda: b.reach.status()["verdict"] != "unknown", FIRST_CHECK_S + 10)
            status = b.reach.status()
            assert status["verdict"] == "unreachable"
            assert status["says"] == (
                f"behind NAT: peers cannot dial {hidden} back; looking for a relay"
            )
            assert b.reach.reach == "unknown", "no relay yet: the record says unknown"
            assert a.reach.counters["dial_back_failed"] == 1
            nursery.cancel_scope.cancel()


async def test_the_prober_dials_the_signed_record_never_the_envelopes_claim(
    tmp_path: Path,
) -> None:
    """b's record advertises a closed port; its request's envelope names c,
    a listening node: the prober must not dial c (anyone could otherwise
    make the swarm dial arbitrary hosts)."""
    hidden = closed_port_address()
    async with (
        node(tmp_path / "a") as a,
        node(tmp_path / "b", advertise=hidden) as b,
        node(tmp_path / "c") as c,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(a.membership.run)
        nursery.start_soon(a.reach.run)
        b.membership.join([(a.membership.node_id, a.membership.address)])
        nursery.start_soon(b.membership.run)
        await until(lambda: record_of(a.membership)(b.membership.node_id) is not None, 5)
        await trio.sleep(FIRST_CHECK_S)  # a's driver takes requests once running
        request = Envelope(b.membership.node_id, c.plane.address, DialRequest(bytes(16)))
        keys = b.membership.identity.plane_keys()
        payload = encode_envelope(request)
        assert await dial_once(keys, a.membership.node_id, a.plane.address, payload, encrypted=True)
        await until(lambda: sum(a.reach.counters.values()) >= 1, 5)
        await until(lambda: a.reach.counters["dial_back_failed"] == 1, 5)
        assert c.plane.received_messages == 0
        # A second request at once is refused: one dial-back per requester per interval.
        assert await dial_once(keys, a.membership.node_id, a.plane.address, payload, encrypted=True)
        await until(lambda: a.reach.counters["requests_refused"] == 1, 5)
        assert a.reach.counters["dial_back_failed"] == 1
        nursery.cancel_scope.cancel()


async def test_an_unasked_dial_back_counts_for_nothing(tmp_path: Path) -> None:
    async with node(tmp_path / "a") as a, node(tmp_path / "b") as b:
        b.reach.handle(a.membership.node_id, DialRequest(bytes(16)))  # not running: refused
        assert b.reach.counters["requests_refused"] == 1
        b.reach.handle(a.membership.node_id, DialBack(bytes(16)))
        assert b.reach.counters["unasked_dial_backs"] == 1
        assert b.reach.status()["verdict"] == "unknown"


def test_the_verdicts_in_words() -> None:
    assert (
        reachability_text("direct", "tcp://10.77.1.2:7001") == "reachable at tcp://10.77.1.2:7001"
    )
    assert reachability_text("unknown", None) == "checking reachability…"
    assert "behind NAT: peers cannot dial tcp://x:1 back" in reachability_text(
        "unreachable", "tcp://x:1"
    )
    assert reachability_text("unreachable", "tcp://x:1", "tcp://r:7101") == (
        "behind NAT: serving through relay tcp://r:7101 (peers cannot dial tcp://x:1)"
    )
    assert reachability_text("unreachable", "tcp://x:1", "tcp://r:7101", 2).endswith(
        "; direct to 2 peers past NAT"
    )
    assert reachability_text("direct", "tcp://a:1", None, 3) == (
        "reachable at tcp://a:1; direct to 3 peers past NAT"
    )


async def test_a_prober_with_every_dial_in_use_refuses_more(tmp_path: Path) -> None:
    async with (
        node(tmp_path / "a") as a,
        node(tmp_path / "b") as b,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(a.membership.run)
        nursery.start_soon(a.reach.run)
        nursery.start_soon(b.membership.run)
        b.membership.join([(a.membership.node_id, a.membership.address)])
        await until(lambda: record_of(a.membership)(b.membership.node_id) is not None, 5)
        await trio.sleep(FIRST_CHECK_S)
        a.reach._serving = MAX_DIALS  # sixteen slow dial-backs under way
        request = encode_envelope(
            Envelope(b.membership.node_id, b.membership.address, DialRequest(bytes(16)))
        )
        keys = b.membership.identity.plane_keys()
        assert await dial_once(keys, a.membership.node_id, a.plane.address, request, encrypted=True)
        await until(lambda: a.reach.counters["requests_busy"] == 1, 5)
        assert a.reach.counters["dialed_back"] == 0
        nursery.cancel_scope.cancel()
