"""Direct paths on real sockets: a punched connection carrying CURVE
ZeroMQ from one node's plane to another's in place of the relayed address,
and the relay again once it closes; and in the WAN lab, TCP simultaneous
open through two port-keeping NAT routers, while a symmetric one lets
none through."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from mesh.identity import Identity
from mesh.punch import PUNCH_TIMEOUT_S, PunchRequest
from mesh.records import Addresses
from runtime.node.direct_paths import (
    NodeDirectPaths,
    Reach,
    _accept_from,
    _bound_socket,
    public_reach,
)
from runtime.node.hostport import HostPort, parse_hostport
from tests.runtime.lab.fixtures import MakeLab, make_lab  # noqa: F401 - the fixture
from tests.runtime.node.test_relay_splice import loopback_planes, serve_api

TIMEOUT_S = 10.0
RELAYED = "tcp://127.0.0.1:9"
"""The peer's relayed address: nothing listens there, so what arrives came direct."""


class NoSwarm:
    """A swarm with no relayed members: `run` punches nothing on its own."""

    node_id = b"\0" * 32

    def records(self) -> list[tuple[Any, Any]]:
        return []

    def dial_addresses(self, node: bytes) -> Addresses | None:
        return None


@pytest.mark.parametrize("ends", ["the stream closes", "the peer leaves the view"])
async def test_a_punched_path_carries_curve_zeromq_in_place_of_the_relay(ends: str) -> None:
    """Then it ends, and the plane sends through the relay again: when the
    punched stream closes, or when the asking node's view no longer has the
    peer as a relayed member (its `run` cancels the path)."""
    home, entry = Identity.generate(), Identity.generate()
    drops: collections.Counter[str] = collections.Counter()
    async with (
        trio.open_nursery() as nursery,
        loopback_planes(home, drops) as (control, data),
        loopback_planes(entry, drops) as (their_control, their_data),
    ):
        local = {"control": parse_hostport(control.address), "data": parse_hostport(data.address)}
        answering = NodeDirectPaths(
            home, NoSwarm(), {"control": control, "data": data}, local,
            lambda: Reach("relayed", "127.0.0.1"),
        )  # fmt: skip
        asking = NodeDirectPaths(
            entry, NoSwarm(), {"control": their_control, "data": their_data}, {},
            lambda: Reach("direct", "127.0.0.1"),
        )  # fmt: skip
        await nursery.start(answering.run)
        listening = _bound_socket("127.0.0.1")
        listening.listen(1)
        port = listening.getsockname()[1]
        with trio.fail_after(TIMEOUT_S):
            meet = await answering.answer(
                entry.node_id, PunchRequest("control", "reverse", "127.0.0.1", port)
            )
            stream = await _accept_from(listening, meet["host"])
            key = asking.book.to_try([(home.node_id, "control")], 0.0)[0]
            asking.book.succeeded(key, "reverse")
            nursery.start_soon(asking._carry, key, stream, Addresses(RELAYED, RELAYED))
            while not their_control._redirects:
                await trio.sleep(0.01)
            their_control.send(RELAYED, [b"hello"], peer=home.node_id)
            got = await control.receive()
        assert got.peer == entry.node_id and got.frames == [b"hello"], "CURVE, end to end"
        assert their_control.talks_to(RELAYED)
        if ends == "the stream closes":
            await stream.aclose()
        else:
            await nursery.start(asking.run)  # its view (NoSwarm) relays nobody
        with trio.fail_after(TIMEOUT_S):
            while their_control._redirects:
                await trio.sleep(0.01)
        assert asking.book.state(key) == ("lost" if ends == "the stream closes" else None)
        assert answering.budget.counters["answered_direct"] == 1
        nursery.cancel_scope.cancel()
    listening.close()


async def test_a_peer_that_answers_a_punch_with_nonsense_fails_that_punch_alone() -> None:
    """A relay or a peer that lies in its answer (here: not JSON at all)
    costs one failed punch, counted; the node goes on."""
    asking = NodeDirectPaths(Identity.generate(), NoSwarm(), {}, {}, lambda: Reach("", None))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_api)  # answers its request line, as text
        key = asking.book.to_try([(b"p" * 32, "data")], 0.0)[0]
        api = HostPort("127.0.0.1", port).http()
        with trio.fail_after(TIMEOUT_S):
            await asking._punch(key, Addresses(RELAYED, RELAYED, api), Reach("direct", "127.0.0.1"))
        nursery.cancel_scope.cancel()
    assert asking.book.state(key) == "failed"
    assert asking.book.counters["failed_no_answer"] == 1


def test_how_a_node_is_met_follows_how_it_is_reached() -> None:
    assert public_reach("direct", "tcp://10.77.1.2:7000", None) == Reach("direct", "10.77.1.2")
    assert public_reach("relayed", "tcp://10.77.2.2:40001", "10.77.4.2") == Reach(
        "relayed", "10.77.4.2"
    )
    assert public_reach("direct", "tcp://node.example:7000", None).host is None, "no DNS names"
    assert public_reach("unknown", "tcp://10.77.1.2:7000", None).host is None


PEER_SCRIPT = """
import sys, trio
from runtime.node.direct_paths import simultaneous_open
async def main(port, host, peer_port, limit):
    with trio.move_on_after(limit):
        stream = await simultaneous_open(port, host, peer_port)
        await stream.send_all(b"hi")
        print("met", (await stream.receive_some(10)).decode(), flush=True)
        return
    print("timeout", flush=True)
trio.run(main, int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
"""
PUNCH_PORT = 45_000


def meeting(peer: str) -> list[str]:
    """Both ends bind PUNCH_PORT and dial it at the other's public address."""
    return [str(PUNCH_PORT), peer, str(PUNCH_PORT)]


@pytest.mark.parametrize(
    ("other", "met"), [("port-preserving", True), ("symmetric", False)]
)  # fmt: skip
def test_a_simultaneous_open_meets_through_port_keeping_nats_only(
    make_lab: MakeLab,  # noqa: F811 - the fixture
    other: str,
    met: bool,
) -> None:
    lab = make_lab(
        {
            "seed": 4,
            "link": {"delay_ms": 10, "jitter_ms": 0, "loss": 0.0},
            "sites": [{"name": "c", "nat": "port-preserving"}, {"name": "d", "nat": other}],
        }
    )
    limit = str(PUNCH_TIMEOUT_S)
    procs = [
        lab.spawn(
            site,
            [sys.executable, "-c", PEER_SCRIPT, *meeting(lab.public_address(peer)), limit],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parents[3],
        )
        for site, peer in (("c", "d"), ("d", "c"))
    ]  # fmt: skip
    said = [proc.communicate(timeout=PUNCH_TIMEOUT_S + 20)[0].strip() for proc in procs]
    assert said == (["met hi", "met hi"] if met else ["timeout", "timeout"])
