"""Fake members, against a real four-node swarm on loopback (issue 30, item 2).

The attack as measured: one admitted key introduced 1,000 made-up ids,
each advertising its own /24 (so the per-address and per-prefix newcomer
limits never applied); 995 were counted alive on every node, resending
revived them, and a real node killed with SIGKILL still showed alive after
150 s, where the profile's bound is 7 s.

Here the attacker is a member that really joined (a membership driver in
this process, on a plane of its own, answering probes like any member). It
gossips its 1,000 fakes to every node twice a second, at a new incarnation
each time, and keeps at it while a real node is SIGKILLed. Every node must
count at most the per-minute bound of them (none of them answers a ping, so
in fact none), route to none, and declare the killed node dead within the
local profile's detection bound. Design: docs/design/membership.md,
"Introductions".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import trio

from mesh.config import MembershipConfig
from mesh.identity import Identity
from mesh.messages import Alive, Envelope, Gossip, alive_signing_bytes
from mesh.newcomers import R_INTRODUCER
from mesh.transport import Plane
from mesh.wire import encode_envelope
from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from tests.swarm_helpers import (
    OBSERVATION_SLACK_S,
    assert_no_internal_errors,
    crash_and_time_death,
    joined_attacker,
    start_swarm,
)

LOCAL = MembershipConfig.local()
FAKES = 1_000
CHUNK = 100
"""Fake Alives per gossip message (a message of 1,000 would do as well)."""
FLOOD_EVERY_S = 0.5
FLOOD_BEFORE_KILL_S = 3.0


def _fake_ids() -> list[Identity]:
    return [Identity.from_seed(hashlib.sha256(b"fake/%d" % i).digest()) for i in range(FAKES)]


def _fake_addr(i: int) -> str:
    return f"tcp://10.{i // 256}.{i % 256}.1:7000"


def _flood_payloads(
    sender: bytes, addr: str, fakes: list[Identity], incarnation: int
) -> list[bytes]:
    alives = [
        Alive(
            who.node_id,
            incarnation,
            _fake_addr(i),
            who.sign(alive_signing_bytes(who.node_id, incarnation, _fake_addr(i))),
        )
        for i, who in enumerate(fakes)
    ]
    return [
        encode_envelope(Envelope(sender, addr, Gossip(tuple(alives[start : start + CHUNK]))))
        for start in range(0, len(alives), CHUNK)
    ]


class _Watch:
    """What the honest nodes showed of the fakes, over every status poll."""

    def __init__(self, fakes: list[Identity]) -> None:
        self.fakes = {who.node_id.hex() for who in fakes}
        self.most_counted = 0
        self.most_candidates = 0
        self.routed: set[str] = set()
        self.polls = 0

    def see(self, views: Views) -> None:
        self.polls += 1
        for view in views.values():
            if view is None:
                continue
            counted = [
                m
                for m in view["members"]
                if m["node_id"] in self.fakes and m["state"] in ("alive", "suspect")
            ]
            self.most_counted = max(self.most_counted, len(counted))
            self.most_candidates = max(self.most_candidates, view.get("candidates", 0))
            text = json.dumps(view.get("coverage", {}))
            self.routed |= {fake for fake in self.fakes if fake in text}


async def _flood(
    plane: Plane, attacker: Identity, fakes: list[Identity], nodes: list[LocalNode]
) -> None:
    incarnation = 0
    while True:
        incarnation += 1  # resending at a higher incarnation once revived them
        payloads = _flood_payloads(attacker.node_id, plane.address, fakes, incarnation)
        for node in nodes:
            if node.running:
                for payload in payloads:
                    plane.send(node.info["control"], [payload], peer=bytes.fromhex(node.node_id))
        await trio.sleep(FLOOD_EVERY_S)


async def _observe(swarm: LocalSwarm, nodes: list[LocalNode], watch: _Watch) -> None:
    while True:
        watch.see(await swarm.views([n for n in nodes if n.running]))
        await trio.sleep(0.2)


@pytest.mark.slow
async def test_one_key_introducing_1000_fake_ids_gets_none_counted_and_masks_no_death(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    nodes = await start_swarm(swarm, 4, eligible=False)
    victim, survivors = nodes[-1], nodes[:-1]
    fakes = _fake_ids()
    watch = _Watch(fakes)
    # Four real nodes and the attacker: 7.1 s on the local profile.
    bound = LOCAL.detection_bound(len(nodes) + 1)
    async with (
        joined_attacker(swarm, nodes, tmp_path / "attacker") as (member, plane),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_flood, plane, member, fakes, nodes)
        nursery.start_soon(_observe, swarm, nodes, watch)
        await trio.sleep(FLOOD_BEFORE_KILL_S)
        took = await crash_and_time_death(
            swarm,
            victim,
            survivors,
            bound,
            "every survivor marks the killed node dead during the flood",
        )
        views = await swarm.views(survivors)
        nursery.cancel_scope.cancel()
    refused = {
        name: (view or {}).get("drops", {}).get(f"membership.{R_INTRODUCER}", 0)
        for name, view in views.items()
    }
    print(
        f"killed node dead everywhere in {took:.2f} s (bound {bound:.2f} s); fake ids counted "
        f"at most {watch.most_counted} over {watch.polls} polls (introduced, unverified: at "
        f"most {watch.most_candidates}); refused {refused}"
    )
    assert took <= bound + OBSERVATION_SLACK_S, (
        f"detection took {took:.2f}s during the flood, over the profile's bound {bound:.2f}s"
    )
    assert watch.polls > 0
    assert watch.most_counted <= LOCAL.introductions_per_member
    assert 0 < watch.most_candidates <= LOCAL.introductions_per_member
    assert watch.routed == set(), f"{len(watch.routed)} fake ids routable"
    for name, count in refused.items():
        assert count >= FAKES - LOCAL.introductions_per_member, (name, views[name])
    await assert_no_internal_errors(swarm, survivors)
