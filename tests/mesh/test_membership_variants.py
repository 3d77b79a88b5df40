"""The protocol switches (`MembershipConfig`'s Lifeguard parts, nacks,
buddy, direct refutation and eager gossip): each, turned the other way,
changes exactly the behaviour it names. Researchers compare variants with
these in the simulator (`[membership] buddy = false`); a switch that did
nothing would make such a comparison silently meaningless.

Scripts on the hand-driven `Net` of `tests.mesh.test_membership`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mesh.config import MembershipConfig
from mesh.membership import MemberState, Send
from mesh.messages import Envelope, Gossip, Ping, PingReq, Suspect
from simulations.scenario import run_scenario
from tests.mesh.test_membership import CONFIG, Net


def variant(**switches: bool) -> MembershipConfig:
    return replace(CONFIG, **switches)


def accusation(net: Net, subject: str, accuser: str) -> Suspect:
    """`accuser`'s signed suspicion of `subject` at its current incarnation."""
    node = net.nodes[subject]
    accuser_id = net.ids[accuser].node_id
    incarnation = node.incarnation
    body = b"shardmesh/suspect/1\x00" + node.node_id + incarnation.to_bytes(8, "big") + accuser_id
    return Suspect(node.node_id, incarnation, accuser_id, net.ids[accuser].sign(body))


def hear(net: Net, listener: str, sender: str, suspect: Suspect) -> None:
    envelope = Envelope(net.ids[sender].node_id, f"tcp://{sender}", Gossip((suspect,)))
    net.nodes[listener].receive(envelope, net.now)


@pytest.mark.parametrize("nacks", [True, False])
def test_a_helper_that_cannot_reach_the_target_nacks_only_with_nacks_on(nacks: bool) -> None:
    net = Net("a", "b", config=variant(nacks=nacks))
    net.join_all()
    b = net.nodes["b"]
    b.receive(Envelope(net.ids["a"].node_id, "tcp://a", PingReq(9, b"\x02" * 32, "tcp://x")), 0.0)
    b.take_sends()
    b.tick(CONFIG.probe_timeout)
    to_a = [type(s.envelope.message).__name__ for s in b.take_sends() if s.addr == "tcp://a"]
    assert to_a == (["Nack"] if nacks else [])


@pytest.mark.parametrize("local_health", [True, False])
def test_failing_probes_slow_a_node_only_with_local_health_on(local_health: bool) -> None:
    net = Net("a", "b", "c", "d", config=variant(local_health=local_health))
    net.join_all()
    a = net.nodes["a"]
    net.keep = lambda send: send.envelope.sender != a.node_id  # a's own link fails
    net.advance(5 * CONFIG.probe_interval)
    assert (a.health > 0) is local_health


@pytest.mark.parametrize("dynamic_suspicion", [True, False])
def test_a_lone_accusation_lasts_the_maximum_only_with_dynamic_suspicion(
    dynamic_suspicion: bool,
) -> None:
    """d crashes and a hears from nobody, so a's suspicion of d stays
    unconfirmed: Lifeguard keeps it for the maximum timeout (and a last
    look), plain SWIM for the minimum."""
    config = variant(dynamic_suspicion=dynamic_suspicion)
    net = Net("a", "b", "c", "d", config=config)
    net.join_all()
    a = net.nodes["a"]
    a.take_events()
    del net.nodes["d"]
    net.keep = lambda send: send.addr != "tcp://a"  # a hears nothing: no confirmation
    net.advance(3 * config.suspicion_max_timeout(4))
    d = net.ids["d"].node_id
    times = {event.kind: event.at for event in a.take_events() if event.node == d}
    lasted = times["dead"] - times["suspect"]
    if dynamic_suspicion:
        assert lasted >= config.suspicion_max_timeout(4)
    else:
        assert lasted == pytest.approx(config.suspicion_min_timeout(4))


@pytest.mark.parametrize("buddy", [True, False])
def test_a_probe_of_a_suspect_carries_the_suspicion_only_with_buddy_on(buddy: bool) -> None:
    """Once gossip has spent the suspicion (one transmit here), only the
    buddy system still tells the suspect, on a's probes of it."""
    net = Net("a", "b", "c", config=variant(buddy=buddy, retransmit_mult=1))
    net.join_all()
    b_id = net.ids["b"].node_id
    pings: list[tuple[float, Ping]] = []

    def keep(send: Send) -> bool:
        message = send.envelope.message
        from_a = send.envelope.sender == net.ids["a"].node_id
        if from_a and isinstance(message, Ping) and message.target == b_id:
            pings.append((net.now, message))
        return send.addr != "tcp://b"  # b never hears, so it never refutes

    net.keep = keep
    hear(net, "a", "c", accusation(net, "b", "c"))
    start = net.now
    net.advance(2 * CONFIG.probe_interval + CONFIG.gossip_interval)
    late = [
        ping
        for at, ping in pings
        if at > start + CONFIG.gossip_interval and net.state("a", "b") is MemberState.SUSPECT
    ]
    assert late, "a probed b while it suspected it"
    carried = [any(isinstance(u, Suspect) and u.node == b_id for u in p.updates) for p in late]
    assert all(carried) if buddy else not any(carried)


@pytest.mark.parametrize("refute_to_accuser", [True, False])
def test_a_refutation_goes_straight_to_the_accuser_only_when_switched_on(
    refute_to_accuser: bool,
) -> None:
    net = Net("a", "b", "c", config=variant(refute_to_accuser=refute_to_accuser))
    net.join_all()
    b = net.nodes["b"]
    before = b.incarnation
    hear(net, "b", "c", accusation(net, "b", "a"))
    assert b.incarnation == before + 1
    direct = [s.addr for s in b.take_sends()]
    assert direct == (["tcp://a"] if refute_to_accuser else [])


@pytest.mark.parametrize("eager_gossip", [True, False])
def test_news_is_gossiped_at_once_only_with_eager_gossip(eager_gossip: bool) -> None:
    """News right after a gossip round waits for the next one (a gossip
    interval later), unless gossip is eager."""
    net = Net("a", "b", "c", "d", config=variant(eager_gossip=eager_gossip))
    net.join_all()
    c = net.nodes["c"]
    hear(net, "c", "b", accusation(net, "a", "b"))
    c.tick(net.now)  # the round that carries the first news
    c.take_sends()
    net.now += CONFIG.gossip_interval / 4
    hear(net, "c", "b", accusation(net, "d", "b"))
    assert (c.next_deadline() <= net.now) is eager_gossip
    c.tick(net.now)
    gossiped = [s for s in c.take_sends() if isinstance(s.envelope.message, Gossip)]
    assert bool(gossiped) is eager_gossip


def test_a_scenario_switches_nacks_off_and_the_metrics_show_none_sent() -> None:
    """The switches are scenario keys (`[membership]`): a crash makes
    helpers nack in the default protocol and never with nacks off."""
    base = {
        "duration": 40.0,
        "nodes": {"count": 20},
        "faults": [{"kind": "crash", "node": 5, "at": 5.0}],
    }
    sent = {}
    for nacks in (True, False):
        scenario = {**base, "membership": {"nacks": nacks}}
        metrics = run_scenario(scenario, seed=3)
        assert metrics["provenance"]["resolved"]["membership"]["nacks"] is nacks
        sent[nacks] = metrics["traffic"]["by_type"].get("Nack", {}).get("messages_per_node_second")
    assert sent[True] and sent[True] > 0
    assert sent[False] is None
