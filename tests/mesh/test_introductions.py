"""Introductions: how many new ids a member may bring in, and when a new id
counts (docs/design/membership.md#introductions).

The attack these close: one admitted key gossiped 1,000 made-up ids, each
advertising its own /24 (so the per-address and per-prefix bounds never
applied); 995 were counted alive on every node, resending revived them, and
a real node killed meanwhile still showed alive after 150 s. Scripted
scenarios on the `Net` driver of tests/mesh/test_membership.py: delivery
when the test says so, virtual time.
"""

from __future__ import annotations

import hashlib

from mesh.config import MembershipConfig
from mesh.identity import Identity
from mesh.membership import R_CANDIDATE_SILENT, MemberState, Send
from mesh.messages import Alive, Gossip, Ping, Record, record_signing_bytes
from mesh.newcomers import R_INTRODUCER, R_INTRODUCTIONS
from tests.mesh.test_membership import CONFIG, Net, identity
from tests.mesh.test_membership_trust import alive, say, suspect

FAKES = [Identity.from_seed(hashlib.sha256(b"fake/%d" % i).digest()) for i in range(1_000)]
"""Made-up ids, as one attacker holds them (it has every key)."""


def fake_addr(i: int) -> str:
    """Each fake advertises its own /24: the newcomer limits per address and
    prefix never apply to them."""
    return f"tcp://10.{i // 256}.{i % 256}.1:7000"


def flood(incarnation: int = 0) -> list[Alive]:
    return [alive(who, incarnation, fake_addr(i)) for i, who in enumerate(FAKES)]


def say_in_chunks(net: Net, sender: Identity, to: str, updates: list[Alive]) -> None:
    for start in range(0, len(updates), 100):
        say(net, sender, to, Gossip(tuple(updates[start : start + 100])))


def fake_members(net: Net, name: str) -> list[bytes]:
    """Fake ids node `name` holds as members (in any state)."""
    fakes = {who.node_id for who in FAKES}
    return [view.node for view in net.nodes[name].members() if view.node in fakes]


def test_one_member_introduces_at_most_its_bound_a_minute_and_none_is_alive() -> None:
    net = Net("a", "b")
    net.join_all()
    a = net.nodes["a"]
    bound = CONFIG.introductions_per_member
    say_in_chunks(net, net.ids["b"], "a", flood())
    bound -= 1  # b introduced itself when it joined: one id of its minute
    assert a.candidates == bound
    assert a.drops[R_INTRODUCER] == len(FAKES) - bound
    assert fake_members(net, "a") == []  # introduced is not alive
    pings = [(s.addr, m) for s in a.take_sends() if isinstance(m := s.envelope.message, Ping)]
    assert len(pings) == bound  # one ping each, to the address it advertises...
    assert {addr for addr, _ in pings} <= {fake_addr(i) for i in range(len(FAKES))}
    assert all(ping.updates == () for _, ping in pings)  # ...carrying no news
    # Nobody answers: a probe interval later they are gone, counted.
    net.advance(CONFIG.probe_interval * 1.5)
    assert a.candidates == 0 and a.drops[R_CANDIDATE_SILENT] == bound
    # Within the minute, resending gets no new id in; a minute on, the
    # next `bound` (learned later, not lost).
    say_in_chunks(net, net.ids["b"], "a", flood(1))
    assert a.candidates == 0
    net.advance(60.0)
    say_in_chunks(net, net.ids["b"], "a", flood(2))
    assert a.candidates == CONFIG.introductions_per_member
    assert fake_members(net, "a") == []


def test_all_introducers_together_bring_in_at_most_the_total_a_minute() -> None:
    config = CONFIG.with_overrides(introductions_per_member=4, introductions_total=6)
    net = Net("a", config=config)
    a = net.nodes["a"]
    for n, introducer in enumerate(identity(f"introducer-{i}") for i in range(3)):
        updates = flood()[n * 10 : n * 10 + 10]
        say(net, introducer, "a", Gossip(tuple(updates)))
    # The first brings in its 4, the second 2 more and the total is spent:
    # the third, within its own bound, gets none in.
    assert a.candidates == 6
    assert a.drops[R_INTRODUCER] == 10 - 4
    assert a.drops[R_INTRODUCTIONS] == (10 - 2) + 10


def test_a_new_id_is_a_member_once_it_answers_our_own_ping() -> None:
    net = Net("a", "b")
    net.join_all()
    a = net.nodes["a"]
    newcomer = FAKES[0]
    net.outsiders[newcomer.node_id] = newcomer  # this one really listens there
    say(net, net.ids["b"], "a", Gossip((alive(newcomer, 0, fake_addr(0)),)))
    assert a.member(newcomer.node_id) is None and a.candidates == 1
    net.deliver()
    view = a.member(newcomer.node_id)
    assert view is not None and view.state is MemberState.ALIVE and view.last_seen == net.now
    assert a.candidates == 0
    assert [e.kind for e in a.take_events() if e.node == newcomer.node_id] == ["joined"]
    # Its news is ours to gossip now; before, it was not (see below).
    net.advance(CONFIG.gossip_interval * 3)
    b = net.nodes["b"]
    assert b.member(newcomer.node_id) is not None


def test_independent_members_vouch_a_new_id_in_and_one_voice_is_one_vouch() -> None:
    config = CONFIG  # lan: three vouches
    assert config.vouches_to_verify == 3
    net = Net("a", "b", "c", "d", config=config)
    net.join_all()
    a = net.nodes["a"]
    unreachable = FAKES[1]  # a's pings to it are lost
    news = Gossip((alive(unreachable, 0, fake_addr(1)),))
    for sender in (net.ids["b"], net.ids["b"], unreachable, identity("stranger"), net.ids["c"]):
        say(net, sender, "a", news)  # b twice, itself, a non-member: no vouches
    a.take_sends()  # the pings: lost
    assert a.member(unreachable.node_id) is None and a.candidates == 1
    say(net, net.ids["d"], "a", news)
    view = a.member(unreachable.node_id)
    assert view is not None and view.state is MemberState.ALIVE and a.candidates == 0


def test_an_accusation_that_came_with_a_new_id_applies_once_it_is_a_member() -> None:
    net = Net("a", "b")
    net.join_all()
    a = net.nodes["a"]
    newcomer = FAKES[2]
    net.outsiders[newcomer.node_id] = newcomer
    accuser = net.ids["b"]
    say(net, accuser, "a", Gossip((alive(newcomer, 0, fake_addr(2)),)))
    say(net, accuser, "a", Gossip((suspect(accuser, newcomer.node_id, 0),)))
    assert a.member(newcomer.node_id) is None
    net.answer_outsiders("a")
    assert net.state("a", "b") is MemberState.ALIVE
    view = a.member(newcomer.node_id)
    assert view is not None and view.state is MemberState.SUSPECT


def _flood_during(net: Net, attacker: Identity, seconds: float) -> int:
    """The attacker resends its 1,000 fakes to every honest node each second,
    at a new incarnation each time (resending once revived them); returns
    the most fakes any node ever held as candidates or members."""
    honest = [name for name in net.nodes if net.ids[name] != attacker]
    most = 0
    for second in range(int(seconds)):
        updates = flood(second + 1)
        for name in honest:
            say_in_chunks(net, attacker, name, updates)
        net.advance(1.0)
        for name in honest:
            assert fake_members(net, name) == [], "a fake id was counted"
            most = max(most, net.nodes[name].candidates)
    return most


def _carries_fakes(messages: list[object]) -> bool:
    fakes = {who.node_id for who in FAKES}
    for message in messages:
        for update in getattr(message, "updates", ()):
            if not isinstance(update, Record) and update.node in fakes:
                return True
    return False


def test_a_real_death_during_a_flood_is_found_within_the_profiles_bound() -> None:
    config = MembershipConfig.local()
    names = ["a", "b", "c", "d", "attacker"]
    net = Net(*names, config=config)
    net.join_all()
    attacker = net.ids["attacker"]
    bound = config.detection_bound(len(names))
    sent: list[object] = []
    keep = net.keep

    def watch(send: object) -> bool:
        sent.append(send.envelope.message)  # type: ignore[attr-defined]
        return keep(send)  # type: ignore[arg-type]

    net.keep = watch
    _flood_during(net, attacker, 3)
    del net.nodes["d"]  # SIGKILL: nothing reaches it, nothing comes from it
    most = _flood_during(net, attacker, bound + 1)
    for observer in ("a", "b", "c"):
        assert net.state(observer, "d") is MemberState.DEAD, observer
        # Fake ids neither count in the swarm's size (timeouts, retransmits)...
        assert len(net.nodes[observer].members()) == len(names)
    assert most <= config.introductions_per_member
    # ...nor ride on anything a node sends (the attacker's flood is `say`s).
    assert sent and not _carries_fakes(sent)


def test_a_candidates_record_is_gossiped_only_once_it_is_a_member() -> None:
    net = Net("a", "b")
    net.join_all()
    a = net.nodes["a"]
    newcomer = FAKES[3]
    body = b"{}"
    signed = Record(newcomer.node_id, 1, body, newcomer.sign(record_signing_bytes(
        newcomer.node_id, 1, body)))  # fmt: skip
    say(net, net.ids["b"], "a", Gossip((alive(newcomer, 0, fake_addr(3)), signed)))
    assert a.record(newcomer.node_id) == signed  # held, for when it is verified
    sent: list[object] = []

    def watch(send: Send) -> bool:
        sent.append(send.envelope.message)
        return True

    net.keep = watch
    a.take_sends()  # its ping: lost
    net.advance(CONFIG.probe_interval * 1.5)  # forgotten, its record kept
    assert a.candidates == 0 and not _carries_fakes(sent), "nothing about it went out"
    net.outsiders[newcomer.node_id] = newcomer
    say(net, net.ids["b"], "a", Gossip((alive(newcomer, 1, fake_addr(3)),)))
    net.deliver()  # it answers the ping this time
    net.advance(CONFIG.gossip_interval * 3)
    gossiped = [u for m in sent for u in getattr(m, "updates", ()) if u.node == newcomer.node_id]
    assert signed in gossiped and any(isinstance(u, Alive) for u in gossiped)
