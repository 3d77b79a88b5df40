"""Who may accuse whom, and how fast new identities get in: scripted
scenarios for the membership core's trust rules (docs/design/membership.md,
"Trust", and `mesh.newcomers`).

The attack these rules close: one gossip message from a key that never
joined declared a node dead at incarnation 2**63 - 1, and the node could
never refute it. The same `Net` driver as tests/mesh/test_membership.py: every
message is delivered when the test says so, and time is virtual.
"""

from __future__ import annotations

import hashlib
from random import Random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.config import MembershipConfig
from mesh.identity import Identity, verify
from mesh.membership import (
    MAX_COUNTER,
    R_ABOVE_SIGNED,
    R_ACCUSER_NOT_ALIVE,
    R_ACCUSER_UNKNOWN,
    R_UNASKED_ACK,
    Membership,
    MemberState,
    Send,
)
from mesh.messages import (
    Ack,
    Alive,
    Dead,
    Envelope,
    Gossip,
    Message,
    Ping,
    PushPull,
    Suspect,
    SyncDelta,
    alive_signing_bytes,
    dead_signing_bytes,
    suspect_signing_bytes,
)
from mesh.newcomers import R_ADDRESS, R_PREFIX
from tests.mesh.test_membership import CONFIG, Net, identity

FORGED_MAX = 2**63 - 1
"""The incarnation the attack named: the wire's largest."""


def suspect(by: Identity, node: bytes, incarnation: int) -> Suspect:
    signature = by.sign(suspect_signing_bytes(node, incarnation, by.node_id))
    return Suspect(node, incarnation, by.node_id, signature)


def dead(by: Identity, node: bytes, incarnation: int) -> Dead:
    return Dead(
        node, incarnation, by.node_id, by.sign(dead_signing_bytes(node, incarnation, by.node_id))
    )


def alive(who: Identity, incarnation: int, addr: str) -> Alive:
    signature = who.sign(alive_signing_bytes(who.node_id, incarnation, addr))
    return Alive(who.node_id, incarnation, addr, signature)


def say(net: Net, sender: Identity, to: str, message: Message) -> None:
    """`sender` sends `message` to node `to` (the transport authenticated
    `sender`; what it says inside is all it controls)."""
    net.nodes[to].receive(Envelope(sender.node_id, "tcp://attacker", message), net.now)


def all_alive(net: Net, names: list[str]) -> bool:
    return all(net.state(o, s) is MemberState.ALIVE for o in names for s in names)


# --- who may accuse ---------------------------------------------------------------


def test_the_attack_a_stranger_declares_a_node_dead_at_the_largest_incarnation() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    stranger = identity("stranger")
    b = net.nodes["b"]
    before = b.incarnation
    for to in "abc":
        for forged in (FORGED_MAX, before):
            say(net, stranger, to, Gossip((dead(stranger, b.node_id, forged),)))
            say(net, stranger, to, Gossip((suspect(stranger, b.node_id, forged),)))
    net.deliver()
    assert all_alive(net, ["a", "b", "c"])
    assert b.incarnation == before, "a stranger's word is not even refuted"
    for observer in "ac":
        drops = net.nodes[observer].drops
        assert drops[R_ABOVE_SIGNED] == 2 and drops[R_ACCUSER_UNKNOWN] == 2, drops
    assert b.drops[R_ABOVE_SIGNED] == 2 and b.drops[R_ACCUSER_UNKNOWN] == 2
    # Refused before its signature is checked: a flood of them costs no
    # signature verification (this one's signature is garbage).
    junk = Dead(b.node_id, before, stranger.node_id, b"\x00" * 64)
    say(net, stranger, "a", Gossip((junk,)))
    assert net.nodes["a"].drops[R_ACCUSER_UNKNOWN] == 3
    assert net.nodes["a"].drops["bad_signature"] == 0


def test_a_member_forging_an_incarnation_the_subject_never_signed_is_dropped() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    liar = net.ids["c"]  # an alive member
    b = net.nodes["b"]
    before = b.incarnation
    for to in "ab":
        say(net, liar, to, Gossip((dead(liar, b.node_id, FORGED_MAX),)))
        say(net, liar, to, Gossip((suspect(liar, b.node_id, before + 1),)))
    net.deliver()
    assert net.state("a", "b") is MemberState.ALIVE
    assert net.nodes["a"].drops[R_ABOVE_SIGNED] == 2
    # Accused of itself above anything it signed, b does not jump its
    # incarnation toward the wire's limit: nobody else believes it either.
    assert b.incarnation == before and b.drops[R_ABOVE_SIGNED] == 2


def test_a_members_accusation_at_the_current_incarnation_is_refuted() -> None:
    """What a member may still do: accuse at the incarnation the subject
    signed. That death stands only until the subject outbids it by one."""
    net = Net("a", "b", "c")
    net.join_all()
    liar = net.ids["c"]
    b = net.nodes["b"]
    before = b.incarnation
    say(net, liar, "a", Gossip((dead(liar, b.node_id, before),)))
    assert net.state("a", "b") is MemberState.DEAD
    net.deliver()  # a gossips the death on; b hears it and refutes
    net.advance(2.0)
    assert b.incarnation == before + 1
    assert all_alive(net, ["a", "b", "c"])


def test_accusations_by_suspect_dead_or_departed_members_are_dropped() -> None:
    net = Net("a", "b", "c", "d", "e")
    net.join_all()
    a, b = net.nodes["a"], net.nodes["b"]
    gone, crashed = net.ids["d"], net.ids["e"]
    net.nodes["d"].leave(net.now)
    net.deliver()
    del net.nodes["d"], net.nodes["e"]
    net.advance(CONFIG.detection_bound(5))
    assert net.state("a", "d") is MemberState.LEFT
    assert net.state("a", "e") is MemberState.DEAD
    # c is suspect at a (b's suspicion, which c has not refuted yet).
    doubted = net.ids["c"]
    suspicion = suspect(net.ids["b"], doubted.node_id, net.nodes["c"].incarnation)
    a.receive(Envelope(b.node_id, "tcp://b", Gossip((suspicion,))), net.now)
    assert net.state("a", "c") is MemberState.SUSPECT
    for accuser in (gone, crashed, doubted):
        say(net, accuser, "a", Gossip((dead(accuser, b.node_id, b.incarnation),)))
        say(net, accuser, "a", Gossip((suspect(accuser, b.node_id, b.incarnation),)))
    assert a.drops[R_ACCUSER_NOT_ALIVE] == 6
    assert net.state("a", "b") is MemberState.ALIVE


def test_a_node_refutes_a_dead_members_accusation_of_itself() -> None:
    """After a partition each side holds the other dead; the refutations
    of those stale accusations are what merge the sides again."""
    net = Net("a", "b", "c")
    net.join_all()
    b = net.nodes["b"]
    before = b.incarnation
    # b holds c dead (say, across a partition), then hears c's old verdict on b.
    verdict = dead(net.ids["a"], net.ids["c"].node_id, net.nodes["c"].incarnation)
    b.receive(Envelope(net.ids["a"].node_id, "tcp://a", Gossip((verdict,))), net.now)
    assert net.state("b", "c") is MemberState.DEAD
    say(net, net.ids["c"], "b", Gossip((dead(net.ids["c"], b.node_id, before),)))
    assert b.incarnation == before + 1
    assert b.drops[R_ACCUSER_NOT_ALIVE] == 0


def test_a_graceful_leave_is_the_subjects_own_word() -> None:
    net = Net("a", "b")
    net.join_all()
    b_id = net.ids["b"]
    say(net, b_id, "a", Gossip((dead(b_id, b_id.node_id, 0),)))
    assert net.state("a", "b") is MemberState.LEFT


def test_a_full_state_carrying_a_strangers_verdict_suspects_nobody() -> None:
    """A full-state sync turns another member's death verdict into our own
    suspicion; a verdict by a stranger (or above the signed incarnation)
    inside a member's full state must not even do that."""
    net = Net("a", "b", "c")
    net.join_all()
    carrier = net.ids["c"]
    stranger = identity("stranger")
    b_id = net.ids["b"].node_id
    states = (dead(stranger, b_id, 0), dead(carrier, b_id, FORGED_MAX))
    say(net, carrier, "a", PushPull(False, True, states, ()))
    assert net.state("a", "b") is MemberState.ALIVE
    drops = net.nodes["a"].drops
    assert drops[R_ACCUSER_UNKNOWN] == 1 and drops[R_ABOVE_SIGNED] == 1


def test_acks_from_anyone_but_the_target_or_an_asked_helper_keep_nobody_alive() -> None:
    """A stranger answers every probe of a crashed member with the right
    sequence number (they are easy to guess): the member is declared dead
    all the same, and the forged acks are counted."""
    net = Net("a", "b", "c", "d")
    net.join_all()
    stranger = identity("stranger")
    d_id = net.ids["d"].node_id
    forged = 0

    def answer_for_d(send: Send) -> bool:
        """d has crashed: nothing reaches it or comes from it; the
        stranger answers every ping meant for it."""
        nonlocal forged
        message = send.envelope.message
        if isinstance(message, Ping) and message.target == d_id:
            say(net, stranger, net.name_of(send.envelope.addr), Ack(message.seq))
            forged += 1
        return send.addr != "tcp://d" and send.envelope.sender != d_id

    net.keep = answer_for_d
    net.advance(CONFIG.detection_bound(4))
    assert forged > 0
    for observer in "abc":
        assert net.state(observer, "d") is MemberState.DEAD
    assert sum(net.nodes[o].drops[R_UNASKED_ACK] for o in "abc") > 0


# --- the property -------------------------------------------------------------------

HONEST = ["h0", "h1", "h2", "h3"]
ATTACKERS = ["stranger", "departed", "crashed", "liar"]
"""Who may send: a key that never joined, a member that left, a member the
swarm holds dead (its key in the wrong hands), and an alive member that may
only forge incarnations its subjects never signed."""


def _swarm_with_attackers(seed: int) -> tuple[Net, dict[str, Identity]]:
    net = Net(*HONEST, "departed", "crashed", "liar", seed=seed)
    net.join_all()
    net.nodes["departed"].leave(net.now)
    net.deliver()
    del net.nodes["departed"], net.nodes["crashed"]
    net.advance(CONFIG.detection_bound(len(net.nodes) + 2))
    keys = {name: net.ids[name] for name in ("departed", "crashed", "liar")}
    keys["stranger"] = identity(f"stranger{seed}")
    return net, keys


attack = st.tuples(
    st.sampled_from(ATTACKERS),
    st.sampled_from(HONEST),  # the victim
    st.sampled_from(HONEST),  # whom the message goes to
    st.sampled_from(["suspect", "dead"]),
    st.sampled_from(["gossip", "push_pull", "sync", "ping"]),
    st.one_of(st.just(FORGED_MAX), st.integers(0, 3), st.integers(1, MAX_COUNTER)),
    st.floats(0.0, 2.0),  # seconds before the next one
)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), attacks=st.lists(attack, min_size=1, max_size=25))
def test_accusations_from_strangers_non_members_or_forgers_never_kill_an_honest_node(
    seed: int, attacks: list[tuple[str, str, str, str, str, int, float]]
) -> None:
    """Property: whatever strangers, departed or dead members send, and
    whatever incarnation an alive member forges above what its subject
    signed, no honest node is ever suspected or declared dead by anyone."""
    net, keys = _swarm_with_attackers(seed)
    for node in net.nodes.values():
        node.take_events()
    for who, victim, to, kind, how, incarnation, pause in attacks:
        key = keys[who]
        victim_id = net.ids[victim].node_id
        if who == "liar":  # only above what the victim signed
            incarnation = max(incarnation, net.nodes[victim].incarnation + 1)
        update: Suspect | Dead
        if kind == "suspect":
            update = suspect(key, victim_id, incarnation)
        else:
            update = dead(key, victim_id, incarnation)
        message: Message
        if how == "gossip":
            message = Gossip((update,))
        elif how == "push_pull":
            message = PushPull(False, seed % 2 == 0, (update,), ())
        elif how == "sync":  # as a delta sync's step two or its reply
            if seed % 2:
                message = SyncDelta(False, 8, (victim_id[0],), (update,), ())
            else:
                message = SyncDelta(True, 0, (), (update,), ())
        else:
            message = Ping(1, net.nodes[to].node_id, (update,))
        say(net, key, to, message)
        net.advance(pause)
    net.advance(CONFIG.suspicion_max_timeout(len(net.nodes)))
    honest = {net.ids[name].node_id for name in HONEST}
    for name in HONEST:
        events = net.nodes[name].take_events()
        bad = [e for e in events if e.kind in ("suspect", "dead") and e.node in honest]
        assert bad == [], (name, bad)
    assert all_alive(net, HONEST)


# --- Sybil bounds ----------------------------------------------------------------------

TIGHT = CONFIG.with_overrides(newcomers_per_address=2, newcomers_per_prefix=3)


def _flood_ids(count: int, addr: str) -> list[Identity]:
    seeds = (hashlib.sha256(f"{addr}/{i}".encode()).digest() for i in range(count))
    return [Identity.from_seed(seed) for seed in seeds]


def _flood(count: int, addr: str) -> list[Alive]:
    """`count` fresh identities, all advertising `addr`."""
    return [alive(who, 0, addr) for who in _flood_ids(count, addr)]


def answer_ping(net: Net, at: str, who: Identity) -> None:
    """`who` (no node of `net`) answers the ping node `at` sent it; the
    rest of what `at` sent stays in flight."""
    net.outsiders[who.node_id] = who
    net.answer_outsiders(at)


def test_new_identities_per_address_and_prefix_are_limited_and_counted() -> None:
    net = Net("a", "b", config=TIGHT)
    net.join_all()
    a = net.nodes["a"]
    carrier = net.ids["b"]  # a member gossiping identities it made up
    one_host = _flood(10, "tcp://10.0.0.1:7000")
    say(net, carrier, "a", Gossip(tuple(one_host)))
    # Learned as candidates (none alive until verified: test_introductions.py).
    assert a.candidates == 2
    assert a.drops[R_ADDRESS] == 8
    neighbours = _flood(1, "tcp://10.0.0.2:7000") + _flood(1, "tcp://10.0.0.3:7000")
    say(net, carrier, "a", Gossip(tuple(neighbours)))
    assert a.candidates == 3 and a.drops[R_PREFIX] == 1
    elsewhere = _flood(1, "tcp://[2001:db8::1]:7000")
    say(net, carrier, "a", Gossip(tuple(elsewhere)))
    assert a.candidates == 4
    # A refused newcomer is only delayed: the same news, once the bucket
    # has refilled, gets it in. The node kept running throughout.
    net.now += 60.0
    say(net, carrier, "a", Gossip(tuple(one_host[2:4])))
    assert a.candidates == 6


def test_a_joiner_learns_a_whole_swarm_from_its_seed_despite_the_limits() -> None:
    net = Net("seed", config=TIGHT)
    seed = net.nodes["seed"]
    crowd_ids = _flood_ids(12, "tcp://10.0.0.1:7000")
    crowd = [alive(who, 0, "tcp://10.0.0.1:7000") for who in crowd_ids]
    # The seed learned them over minutes (within its own limits), each
    # answering the seed's ping at the address it advertises.
    for i, (who, member) in enumerate(zip(crowd_ids, crowd, strict=True)):
        net.now = 60.0 * i
        say(net, net.ids["seed"], "seed", Gossip((member,)))
        answer_ping(net, "seed", who)
    assert len(seed.members()) == 13
    joiner = net.start("joiner")
    joiner.join([(seed.node_id, "tcp://seed")], net.now)
    net.deliver()
    assert len(joiner.members()) == 14
    assert joiner.drops[R_ADDRESS] == 0
    # The same full state, unasked and from someone else, is charged.
    late = net.start("late")
    stranger_state = PushPull(False, True, tuple(crowd), ())
    late.receive(Envelope(net.ids["joiner"].node_id, "tcp://joiner", stranger_state), net.now)
    assert late.candidates == 2 and late.drops[R_ADDRESS] == 10


class OneHostNet(Net):
    """A `Net` whose nodes all listen on 127.0.0.1, one port each, as a
    loopback swarm (or a lab host running many nodes) does."""

    def start(self, name: str, incarnation: int = 0, body: bytes | None = b"{}") -> Membership:
        ident = self.ids.setdefault(name, identity(name))
        node = Membership(
            signer=ident,
            verifier=verify,
            addr=self.addr_of(name),
            config=self.config,
            rng=Random(f"{self.seed}/{name}"),
            now=self.now,
            incarnation=incarnation,
            record_body=body,
        )
        self.nodes[name] = node
        return node

    def addr_of(self, name: str) -> str:
        return f"tcp://127.0.0.1:{7000 + sorted(self.ids).index(name)}"

    def name_of(self, addr: str) -> str:
        return sorted(self.ids)[int(addr.rsplit(":", 1)[1]) - 7000]

    def join_all(self) -> None:
        first, *rest = self.nodes
        for name in rest:
            self.nodes[name].join([(self.ids[first].node_id, self.addr_of(first))], self.now)
        self.deliver()
        self.advance(3.0)


@pytest.mark.parametrize("profile", ["lan", "local"])
def test_forty_nodes_on_one_host_all_get_in(profile: str) -> None:
    """A lab host (lan) or a loopback test swarm (local) starting forty
    nodes at once is within the profile's bound: nobody is refused."""
    config = MembershipConfig.profile(profile)
    names = [f"n{i:02}" for i in range(40)]
    net = OneHostNet(config=config)
    for name in names:
        net.ids[name] = identity(name)
    for name in names:
        net.start(name)
    net.join_all()
    net.advance(config.push_pull_interval)
    assert all_alive(net, names)
    assert not any(node.drops[R_ADDRESS] or node.drops[R_PREFIX] for node in net.nodes.values())
