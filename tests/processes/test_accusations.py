"""The forged death, against a real three-node swarm on loopback (issue 14).

The attack: one gossip message from a key that never joined declared a
node dead at incarnation 2**63 - 1, and the node stayed dead to every peer
for good (nothing can outbid the wire's largest incarnation). Here the same
message is sent by a stranger and by a member that really joined (a
membership driver in this process, on a plane of its own, answering probes
like any member), at the largest incarnation and at the current one. Each
must be ignored, or refuted by the victim within one suspicion timeout;
chat through the victim keeps answering, and every node's status shows the
victim alive.
"""

from __future__ import annotations

import collections
from pathlib import Path

import httpx
import pytest
import trio

from mesh.config import MembershipConfig
from mesh.identity import Identity
from mesh.membership import R_ABOVE_SIGNED, R_ACCUSER_UNKNOWN
from mesh.messages import Dead, Envelope, Gossip, Suspect, dead_signing_bytes, suspect_signing_bytes
from mesh.transport import Plane
from mesh.wire import encode_envelope
from runtime.cli.localswarm import LocalNode, LocalSwarm, Views, all_see, member_field
from runtime.model.tiny import make_tiny_model
from tests.swarm_helpers import (
    ADMIT_TIMEOUT_S,
    START_TIMEOUT_S,
    assert_no_internal_errors,
    control_plane,
    joined_attacker,
    wait_for,
)

MODEL = "tiny"
FORGED_MAX = 2**63 - 1
LOCAL = MembershipConfig.local()
SUSPICION_TIMEOUT_S = LOCAL.suspicion_max_timeout(4)
"""One suspicion timeout in this swarm (three nodes and the member
attacker), at its longest: what a forged death may last at most."""


async def _swarm_with_victim(swarm: LocalSwarm, folder: Path) -> tuple[LocalNode, list[LocalNode]]:
    """Three nodes; the victim serves the whole tiny model, so every chat
    goes through it, and it is not the founder (a leader's death would
    also stir Raft, which is not what this test is about)."""
    model_dir = make_tiny_model(folder / MODEL, layers=4, name=MODEL)
    founder = swarm.new_node("founder")
    victim = swarm.new_node("victim", args=["--model", str(model_dir), "--layers", "0:4"])
    entry = swarm.new_node("entry")
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await swarm.start_many([victim, entry], [founder.seed], timeout=START_TIMEOUT_S)
    nodes = [founder, victim, entry]

    def ready(views: Views) -> bool:
        coverage = (views.get(entry.name) or {}).get("coverage", {}).get(MODEL)
        return all_see(nodes, nodes, "alive")(views) and bool(coverage) and not coverage["gaps"]

    await wait_for(swarm, nodes, ready, ADMIT_TIMEOUT_S, "membership and the model covered")
    return victim, nodes


async def _chat(client: httpx.AsyncClient, node: LocalNode) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return (await client.post(node.api + "/v1/chat/completions", json=body)).status_code


def _accusations(accuser: Identity, victim: bytes, incarnation: int) -> Gossip:
    def signed_dead() -> Dead:
        signature = accuser.sign(dead_signing_bytes(victim, incarnation, accuser.node_id))
        return Dead(victim, incarnation, accuser.node_id, signature)

    def signed_suspect() -> Suspect:
        signature = accuser.sign(suspect_signing_bytes(victim, incarnation, accuser.node_id))
        return Suspect(victim, incarnation, accuser.node_id, signature)

    return Gossip((signed_suspect(), signed_dead()))


def _send_to_all(plane: Plane, accuser: Identity, gossip: Gossip, nodes: list[LocalNode]) -> None:
    payload = encode_envelope(Envelope(accuser.node_id, plane.address, gossip))
    for node in nodes:
        plane.send(node.info["control"], [payload], peer=bytes.fromhex(node.node_id))


async def _victim_stays_alive(
    swarm: LocalSwarm, nodes: list[LocalNode], victim: LocalNode, *, refuted_above: int | None
) -> None:
    """Watch every node for one suspicion timeout: the victim is alive
    everywhere by the end (refuted: at an incarnation above
    `refuted_above`); ignored (`refuted_above` None): never anything but
    alive, at an unchanged incarnation, all along."""
    deadline = trio.current_time() + SUSPICION_TIMEOUT_S

    def field(views: Views, name: str) -> dict[str, object]:
        return {node: member_field(view, victim.node_id, name) for node, view in views.items()}

    before = field(await swarm.views(nodes), "incarnation")
    while True:
        views = await swarm.views(nodes)
        states, incarnations = field(views, "state"), field(views, "incarnation")
        if refuted_above is None:
            assert set(states.values()) == {"alive"}, states
            assert incarnations == before, (incarnations, before)
        elif set(states.values()) == {"alive"} and all(
            isinstance(seen, int) and seen > refuted_above for seen in incarnations.values()
        ):
            return
        if trio.current_time() >= deadline:
            break
        await trio.sleep(0.1)
    assert refuted_above is None, (
        f"not refuted within {SUSPICION_TIMEOUT_S:.1f} s: {states} {incarnations}"
    )


@pytest.mark.slow
async def test_a_forged_death_is_ignored_or_refuted_within_one_suspicion_timeout(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    victim, nodes = await _swarm_with_victim(swarm, tmp_path / "models")
    victim_id = bytes.fromhex(victim.node_id)
    drops: collections.Counter[str] = collections.Counter()
    stranger = Identity.generate()
    async with (
        httpx.AsyncClient(timeout=30) as client,
        control_plane(stranger, drops) as stranger_plane,
        # The member attacker joins for real and answers probes throughout.
        joined_attacker(swarm, nodes, tmp_path / "attacker") as (member, member_plane),
    ):
        assert await _chat(client, nodes[2]) == 200
        incarnation = member_field(await swarm.status(victim), victim.node_id, "incarnation")

        # Ignored: a stranger at the largest and at the current incarnation,
        # and a member at the largest (the attack of the issue).
        _send_to_all(stranger_plane, stranger, _accusations(stranger, victim_id, FORGED_MAX), nodes)
        _send_to_all(
            stranger_plane, stranger, _accusations(stranger, victim_id, incarnation), nodes
        )
        _send_to_all(member_plane, member, _accusations(member, victim_id, FORGED_MAX), nodes)
        await _victim_stays_alive(swarm, nodes, victim, refuted_above=None)
        assert await _chat(client, nodes[2]) == 200
        for name, view in (await swarm.views(nodes)).items():
            assert view is not None
            counted = view["drops"]
            # 2 from the stranger at the largest, 2 from the member.
            assert counted.get(f"membership.{R_ABOVE_SIGNED}", 0) >= 4, (name, counted)
            assert counted.get(f"membership.{R_ACCUSER_UNKNOWN}", 0) >= 2, (name, counted)

        # Refuted: a member may accuse at the incarnation the victim
        # signed; the victim outbids it within one suspicion timeout.
        _send_to_all(member_plane, member, _accusations(member, victim_id, incarnation), nodes)
        await _victim_stays_alive(swarm, nodes, victim, refuted_above=incarnation)
        assert await _chat(client, nodes[2]) == 200
    await assert_no_internal_errors(swarm, nodes)
