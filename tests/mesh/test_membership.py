"""Scripted scenarios for the SWIM/Lifeguard core, driven by hand.

Each test reads as a script: who sends what, which messages are lost, how
much time passes, what every node then believes. The `Net` below is the
smallest possible driver: it holds in-flight messages and delivers them when
told, so a test decides exactly which ones arrive.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.config import MembershipConfig
from mesh.identity import Identity, verify
from mesh.membership import RTT_SAMPLES, Membership, MemberState, Send
from mesh.messages import (
    Ack,
    Alive,
    Dead,
    Envelope,
    Gossip,
    Ping,
    PingReq,
    PushPull,
    Record,
    Suspect,
    alive_signing_bytes,
    record_signing_bytes,
)

CONFIG = MembershipConfig.lan()


def identity(name: str) -> Identity:
    return Identity.from_seed(name.encode().ljust(32, b"."))


class Net:
    """Nodes by name; sends wait in `inflight` until delivered or dropped."""

    def __init__(self, *names: str, seed: int = 7, config: MembershipConfig = CONFIG) -> None:
        self.now = 0.0
        self.config = config
        self.nodes: dict[str, Membership] = {}
        self.ids: dict[str, Identity] = {}
        self.inflight: list[Send] = []
        self.seed = seed
        self.keep: Callable[[Send], bool] = lambda send: True
        self.outsiders: dict[bytes, Identity] = {}
        """Identities no core runs that answer every ping sent to them: a
        test's third parties, verified as a real member would be (a new id
        is a member only once it answers: docs/design/membership.md)."""
        for name in names:
            self.start(name)

    def start(self, name: str, incarnation: int = 0, body: bytes | None = b"{}") -> Membership:
        ident = self.ids.setdefault(name, identity(name))
        node = Membership(
            signer=ident,
            verifier=verify,
            addr=f"tcp://{name}",
            config=self.config,
            rng=random.Random(f"{self.seed}/{name}"),
            now=self.now,
            incarnation=incarnation,
            record_body=body,
        )
        self.nodes[name] = node
        return node

    def name_of(self, addr: str) -> str:
        return addr.removeprefix("tcp://")

    def collect(self) -> None:
        for node in self.nodes.values():
            self.inflight.extend(node.take_sends())

    def deliver(self) -> int:
        """Deliver everything in flight (and what it causes) until quiet.

        A message is lost when its addressee is gone or `self.keep` says so.
        """
        delivered = 0
        for _ in range(10_000):
            self.collect()
            if not self.inflight:
                return delivered
            batch, self.inflight = self.inflight, []
            for send in batch:
                if send.node in self.outsiders:
                    delivered += self._answer(send)
                    continue
                to = self.name_of(send.addr)
                if to not in self.nodes or not self.keep(send):
                    continue
                # The core names the node it means: the transport
                # authenticates that id before anything is delivered.
                assert send.node == self.nodes[to].node_id
                self.nodes[to].receive(send.envelope, self.now)
                delivered += 1
        raise AssertionError("messages never stopped flowing")

    def _answer(self, send: Send) -> int:
        """An outsider acks a ping sent to it (anything else it ignores)."""
        message = send.envelope.message
        if not isinstance(message, Ping) or not self.keep(send):
            return 0
        who = self.outsiders[send.node]
        prober = self.nodes[self.name_of(send.envelope.addr)]
        prober.receive(Envelope(who.node_id, send.addr, Ack(message.seq, ())), self.now)
        return 1

    def answer_outsiders(self, name: str) -> None:
        """Deliver now only the pings node `name` sent to outsiders; the
        rest of what it sent stays in flight."""
        for send in self.nodes[name].take_sends():
            if send.node in self.outsiders:
                self._answer(send)
            else:
                self.inflight.append(send)

    def advance(self, seconds: float) -> None:
        """Let time pass, firing timers in order and delivering as we go."""
        end = self.now + seconds
        while True:
            due = min(node.next_deadline() for node in self.nodes.values())
            if due > end:
                break
            self.now = max(self.now, due)
            for node in self.nodes.values():
                if node.next_deadline() <= self.now:
                    node.tick(self.now)
            self.deliver()
        self.now = end

    def state(self, observer: str, subject: str) -> MemberState | None:
        view = self.nodes[observer].member(self.ids[subject].node_id)
        return None if view is None else view.state

    def join_all(self) -> None:
        first, *rest = self.nodes
        for name in rest:
            self.nodes[name].join([(self.ids[first].node_id, f"tcp://{first}")], self.now)
        self.deliver()
        self.advance(3.0)


def test_nodes_that_join_through_one_seed_learn_of_each_other() -> None:
    net = Net("a", "b", "c", "d")
    net.join_all()
    for observer in "abcd":
        for subject in "abcd":
            assert net.state(observer, subject) is MemberState.ALIVE, (observer, subject)
        records = [m.record for m in net.nodes[observer].members()]
        assert all(r is not None for r in records)


def test_a_silent_member_is_suspected_then_declared_dead() -> None:
    net = Net("a", "b", "c", "d")
    net.join_all()
    del net.nodes["d"]  # crashed: nothing reaches it, nothing comes from it
    net.advance(CONFIG.probe_interval * 8)
    states = {net.state(o, "d") for o in "abc"}
    assert MemberState.SUSPECT in states or MemberState.DEAD in states
    net.advance(CONFIG.suspicion_max_timeout(4) + 5)
    for observer in "abc":
        assert net.state(observer, "d") is MemberState.DEAD


def test_a_suspected_member_refutes_with_a_higher_incarnation() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    b = net.nodes["b"]
    before = b.incarnation
    accusation = Suspect(b.node_id, before, net.ids["a"].node_id, b"")
    signed = Suspect(
        accusation.node,
        accusation.incarnation,
        accusation.accuser,
        net.ids["a"].sign(
            b"shardmesh/suspect/1\x00" + b.node_id + before.to_bytes(8, "big") + accusation.accuser
        ),
    )
    net.nodes["c"].receive(Envelope(net.ids["a"].node_id, "tcp://a", Gossip((signed,))), net.now)
    assert net.state("c", "b") is MemberState.SUSPECT
    b.receive(Envelope(net.ids["a"].node_id, "tcp://a", Gossip((signed,))), net.now)
    assert b.incarnation == before + 1
    net.advance(2.0)
    assert net.state("c", "b") is MemberState.ALIVE
    assert net.nodes["c"].member(b.node_id).incarnation == before + 1


def test_indirect_probes_save_a_member_whose_direct_link_is_lossy() -> None:
    net = Net("a", "b", "c", "d")
    net.join_all()
    a, d = net.nodes["a"], net.nodes["d"]
    # Everything a sends straight to d is lost; helpers can still reach d.
    net.keep = lambda send: not (send.envelope.sender == a.node_id and send.addr == "tcp://d")
    net.advance(40 * CONFIG.probe_interval)
    assert net.state("a", "d") is MemberState.ALIVE
    assert d.incarnation == 0


def test_a_forged_alive_is_rejected_and_counted() -> None:
    net = Net("a", "b")
    net.join_all()
    b_id = net.ids["b"].node_id
    forged = Alive(b_id, 99, "tcp://evil", net.ids["a"].sign(alive_signing_bytes(b_id, 99, "x")))
    victim = net.nodes["a"]
    victim.receive(Envelope(b_id, "tcp://evil", Gossip((forged,))), net.now)
    assert victim.drops["bad_signature"] == 1
    assert victim.member(b_id).incarnation == 0
    assert victim.member(b_id).addr == "tcp://b"


def test_a_record_signed_by_another_key_is_rejected() -> None:
    net = Net("a", "b")
    net.join_all()
    b_id = net.ids["b"].node_id
    body = b"\xa0"
    forged = Record(b_id, 50, body, net.ids["a"].sign(record_signing_bytes(b_id, 50, body)))
    net.nodes["a"].receive(Envelope(b_id, "tcp://b", Gossip((forged,))), net.now)
    assert net.nodes["a"].drops["bad_signature"] == 1
    assert net.nodes["a"].record(b_id).seq == 1


def test_an_older_record_seq_is_rejected_as_stale_and_a_newer_one_wins() -> None:
    net = Net("a", "b")
    net.join_all()
    b = net.nodes["b"]
    first = b.record(b.node_id)
    newer = b.publish_record(b"new", net.now)
    net.advance(1.0)
    a = net.nodes["a"]
    assert a.record(b.node_id) == newer
    a.receive(Envelope(b.node_id, "tcp://b", Gossip((first,))), net.now)
    assert a.drops["stale_record"] == 1
    assert a.record(b.node_id) == newer


def test_a_record_body_the_validator_refuses_is_dropped_with_its_reason() -> None:
    net = Net("a")
    strict = Membership(
        signer=identity("v"),
        verifier=verify,
        addr="tcp://v",
        config=CONFIG,
        rng=random.Random(1),
        now=0.0,
        validate_record_body=lambda body: None if body.startswith(b"ok") else "record_malformed",
    )
    a = net.nodes["a"]
    bad = a.publish_record(b"garbage", 0.0)
    good = a.publish_record(b"ok fine", 0.0)
    strict.receive(Envelope(a.node_id, "tcp://a", Gossip((bad,))), 0.0)
    assert strict.drops["record_malformed"] == 1
    strict.receive(Envelope(a.node_id, "tcp://a", Gossip((good,))), 0.0)
    assert strict.record(a.node_id) == good


def test_a_graceful_leave_marks_the_node_left_not_dead() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    net.nodes["c"].leave(net.now)
    net.deliver()
    net.advance(1.0)
    del net.nodes["c"]
    net.advance(CONFIG.suspicion_max_timeout(3) + 5)
    assert net.state("a", "c") is MemberState.LEFT
    assert net.state("b", "c") is MemberState.LEFT


def test_a_restarted_node_keeps_its_id_and_outbids_its_old_incarnation() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    del net.nodes["c"]
    net.advance(CONFIG.detection_bound(3))
    assert net.state("a", "c") is MemberState.DEAD
    dead_at = net.nodes["a"].member(net.ids["c"].node_id).incarnation
    # Restart from scratch: incarnation 0, record seq 1 again.
    reborn = net.start("c", incarnation=0, body=b"second life")
    reborn.join([(net.ids["a"].node_id, "tcp://a")], net.now)
    net.deliver()
    net.advance(3.0)
    assert reborn.incarnation > dead_at
    for observer in "ab":
        view = net.nodes[observer].member(reborn.node_id)
        assert view.state is MemberState.ALIVE
        assert view.record.body == b"second life"


def test_a_partition_heals_back_to_full_membership() -> None:
    net = Net("a", "b", "c", "d", "e", "f")
    net.join_all()
    left, right = {"a", "b", "c"}, {"d", "e", "f"}
    net.keep = lambda s: (net.name_of(s.addr) in left) == (net.name_of(s.envelope.addr) in left)
    net.advance(CONFIG.detection_bound(6))
    for observer in left:
        for subject in right:
            assert net.state(observer, subject) is MemberState.DEAD
    net.keep = lambda send: True
    net.advance(CONFIG.reconnect_interval * 3 + CONFIG.push_pull_interval)
    for observer in "abcdef":
        for subject in "abcdef":
            assert net.state(observer, subject) is MemberState.ALIVE, (observer, subject)


def test_a_stranger_that_probes_us_is_asked_for_its_state() -> None:
    net = Net("a", "b")
    a, b = net.nodes["a"], net.nodes["b"]
    b.receive(Envelope(a.node_id, "tcp://a", Ping(1, b.node_id)), 0.0)
    sends = b.take_sends()
    asks = [s for s in sends if isinstance(s.envelope.message, PushPull)]
    assert [s.addr for s in asks] == ["tcp://a"]
    # The request carries only b's own entry, so it cannot amplify.
    assert [u.node for u in asks[0].envelope.message.states] == [b.node_id]
    net.inflight.extend(sends)
    net.deliver()
    assert net.state("b", "a") is MemberState.ALIVE


def test_probes_for_another_node_at_our_address_are_not_answered() -> None:
    net = Net("a", "b")
    net.join_all()
    b = net.nodes["b"]
    b.receive(Envelope(net.ids["a"].node_id, "tcp://a", Ping(5, b"\x01" * 32)), net.now)
    assert b.drops["wrong_target"] == 1
    assert b.take_sends() == []


def test_an_unanswered_relayed_probe_returns_a_nack() -> None:
    net = Net("a", "b")
    net.join_all()
    b = net.nodes["b"]
    b.receive(Envelope(net.ids["a"].node_id, "tcp://a", PingReq(9, b"\x02" * 32, "tcp://x")), 0.0)
    (ping,) = b.take_sends()
    assert ping.addr == "tcp://x" and isinstance(ping.envelope.message, Ping)
    b.tick(CONFIG.probe_timeout)
    nacks = [s for s in b.take_sends() if s.addr == "tcp://a"]
    assert [type(s.envelope.message).__name__ for s in nacks] == ["Nack"]
    assert nacks[0].envelope.message.seq == 9


def test_a_relayed_ack_reaches_the_requester() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    b = net.nodes["b"]
    c_id = net.ids["c"].node_id
    b.receive(Envelope(net.ids["a"].node_id, "tcp://a", PingReq(3, c_id, "tcp://c")), 0.0)
    (ping,) = b.take_sends()
    b.receive(Envelope(c_id, "tcp://c", Ack(ping.envelope.message.seq)), 0.01)
    (forwarded,) = b.take_sends()
    assert forwarded.addr == "tcp://a" and forwarded.envelope.message == Ack(3)


def test_lifeguard_slows_probing_when_our_own_probes_fail_without_nacks() -> None:
    net = Net("a", "b", "c", "d")
    net.join_all()
    a = net.nodes["a"]
    assert a.health == 0
    # a's outbound messages vanish: its own link is the problem.
    net.keep = lambda send: send.envelope.sender != a.node_id
    net.advance(5 * CONFIG.probe_interval)
    assert a.health > 0
    # Nobody else was declared dead on a's word, because a's accusations
    # never left it either, and other members still see each other alive.
    for observer in "bcd":
        for subject in "bcd":
            assert net.state(observer, subject) is MemberState.ALIVE


def test_an_accusation_about_an_unknown_node_changes_nothing() -> None:
    net = Net("a")
    a = net.nodes["a"]
    stranger = identity("stranger").node_id
    a.receive(Envelope(stranger, "tcp://s", Gossip((Dead(stranger, 3, stranger, b"x" * 64),))), 0)
    assert a.member(stranger) is None


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    loss=st.floats(0.0, 0.1),
    size=st.integers(3, 7),
)
def test_random_loss_without_crashes_never_kills_anyone(seed: int, loss: float, size: int) -> None:
    """Property: however messages are lost (up to 10%, the target's loss
    rate), with no crash and no partition, nobody is ever declared dead."""
    names = [f"n{i}" for i in range(size)]
    net = Net(*names, seed=seed)
    net.join_all()
    rng = random.Random(seed)
    net.keep = lambda send: rng.random() >= loss
    for _ in range(60):
        net.advance(0.5)
        for node in net.nodes.values():
            for event in node.take_events():
                assert event.kind != "dead", "a live node was declared dead"
    net.keep = lambda send: True
    net.advance(5.0)
    for observer in names:
        for subject in names:
            assert net.state(observer, subject) is MemberState.ALIVE


def test_a_join_nobody_answers_backs_off_and_a_late_answer_ends_it() -> None:
    net = Net("a", "b")
    lost = net.nodes["b"]
    seed = (net.ids["a"].node_id, "tcp://nobody")  # an address where no node listens
    lost.join([seed], net.now)
    sent_at = [net.now]
    lost.take_sends()
    while len(sent_at) < 7:
        net.now = lost.next_deadline()
        lost.tick(net.now)
        if any(s.addr == "tcp://nobody" for s in lost.take_sends()):
            sent_at.append(net.now)
    gaps = [round((b - a) / CONFIG.join_retry_interval) for a, b in itertools.pairwise(sent_at)]
    assert gaps == [1, 2, 4, 8, 8, 8]
    assert lost.joining == (False, 7)
    # The seed at last answers: joining ends, and no more attempts go out.
    lost.join([(net.ids["a"].node_id, "tcp://a")], net.now)
    net.deliver()
    assert lost.joining[0]


def test_two_live_processes_with_one_key_learn_of_each_other_and_a_restart_does_not() -> None:
    net = Net("a", "b")
    net.join_all()
    # A restart of b (same key, new address, the next incarnation, as the
    # state dir gives it): its previous life is no twin.
    del net.nodes["b"]
    net.advance(CONFIG.detection_bound(2))
    net.ids["b2"] = net.ids["b"]
    reborn = net.start("b2", incarnation=1)
    reborn.join([(net.ids["a"].node_id, "tcp://a")], net.now)
    net.deliver()
    net.advance(3.0)
    assert reborn.twin_addr is None and not [e for e in reborn.take_events() if e.kind == "twin"]
    # A copy of b2's state dir started while b2 runs: both sign b's id.
    net.ids["b3"] = net.ids["b"]
    copy = net.start("b3", incarnation=2)
    copy.join([(net.ids["a"].node_id, "tcp://a")], net.now)
    net.deliver()
    # a now sends to b's id at the copy's address; b2 hears of the copy at
    # its next full-state sync with a at the latest, then tells the copy.
    net.advance(2 * CONFIG.push_pull_period(2))
    assert reborn.twin_addr == "tcp://b3" and copy.twin_addr == "tcp://b2"


def test_a_node_nobody_can_dial_becomes_a_member_once_it_advertises_a_relayed_address() -> None:
    net = Net("a")
    home = net.start("home")
    # Behind NAT: what home sends goes out, nothing sent to its own address arrives.
    net.keep = lambda send: send.addr != "tcp://home"
    home.join([(net.ids["a"].node_id, "tcp://a")], net.now)
    net.advance(3.0)
    assert net.nodes["a"].member(home.node_id) is None, "its ping never answered: no member"
    assert not home.joining[0]
    # A relay gives it another address that reaches it (the relay splices).
    net.nodes["relayed-home"] = home
    before = home.incarnation
    home.set_address("tcp://relayed-home", net.now)
    assert home.incarnation == before + 1, "a new Alive names the new address"
    net.advance(3.0)
    seen = net.nodes["a"].member(home.node_id)
    assert seen is not None and seen.addr == "tcp://relayed-home"
    assert seen.state is MemberState.ALIVE and home.joining[0]
    assert home.twin_addr is None, "its own former address is no twin"


def test_a_member_that_moves_tells_every_live_member_at_once() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    net.advance(2.0)
    mover = net.nodes["c"]
    mover.take_sends()
    net.nodes["c-moved"] = mover
    mover.set_address("tcp://c-moved", net.now)
    told = {
        send.node
        for send in mover.take_sends()
        if isinstance(send.envelope.message, Gossip)
        and any(getattr(u, "addr", None) == "tcp://c-moved" for u in send.envelope.message.updates)
    }
    assert told == {net.ids["a"].node_id, net.ids["b"].node_id}


def _probe_round_trip(net: Net, prober: str, delay: float) -> bytes:
    """Run `prober`'s next probe with `delay` seconds between its ping going
    out and the ack coming back (everything else arrives at once); returns
    the probed member's id."""
    core = net.nodes[prober]
    for _ in range(100):  # timers until the next probe round starts
        net.deliver()
        net.now = core.next_deadline()
        core.tick(net.now)
        sends = core.take_sends()
        pings = [s for s in sends if isinstance(s.envelope.message, Ping)]
        net.inflight.extend(s for s in sends if s not in pings)
        if pings:
            break
    assert len(pings) == 1, pings
    net.deliver()
    net.now += delay
    net.nodes[net.name_of(pings[0].addr)].receive(pings[0].envelope, net.now)
    net.deliver()
    return pings[0].node


def test_the_probe_that_opened_the_connection_times_nothing() -> None:
    """Its round trip includes the handshake: a member probed once has no
    round trip yet, rather than one several times too long."""
    net = Net("a", "b")
    net.nodes["a"].join([(net.ids["b"].node_id, "tcp://b")], net.now)
    net.deliver()
    a, b = net.nodes["a"], net.ids["b"].node_id
    assert b not in a.rtts()
    _probe_round_trip(net, "a", 0.12)
    assert b not in a.rtts(), "the first probe's round trip is the handshake's"
    _probe_round_trip(net, "a", 0.04)
    assert a.rtts()[b] == pytest.approx(0.04)


def test_direct_probes_time_each_members_round_trip_as_the_least_of_the_last() -> None:
    net = Net("a", "b", "c")
    net.join_all()
    a = net.nodes["a"]
    for _ in range(2):  # a second probe of each member: the first opened its connection
        _probe_round_trip(net, "a", 0.0)
    assert set(a.rtts().values()) == {0.0}  # the instant network of join_all
    first = _probe_round_trip(net, "a", 0.04)
    assert a.rtts()[first] == 0.0, "one slow ack does not raise the estimate"
    for _ in range(4 * RTT_SAMPLES):  # two members: every other probe is `first`'s
        _probe_round_trip(net, "a", 0.04)
    assert a.rtts()[first] == pytest.approx(0.04), "a path that got longer is followed"
    assert set(a.rtts()) <= {net.ids["b"].node_id, net.ids["c"].node_id}
    del net.nodes["b" if first == net.ids["b"].node_id else "c"]
    net.advance(CONFIG.suspicion_max_timeout(3) + 10 * CONFIG.probe_interval)
    assert first not in a.rtts()  # a dead member has no round trip
