"""Delta sync (`mesh.sync`): digests, deltas, and what they must leave equal.

Two cores are given different views of the same third-party members (by
signed updates, as gossip would bring them), then run one delta sync by
hand through the `Net` driver of tests/mesh/test_membership.py. The properties:
the two end with identical tables, and with exactly the views a full
push-pull exchange would have left; two tables that agree exchange one
digest and nothing else; a digest or delta out of shape is dropped and
counted, and the node keeps working.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.identity import Identity
from mesh.membership import R_SYNC_MALFORMED, Membership, MemberState
from mesh.messages import (
    Envelope,
    Gossip,
    Ping,
    PushPull,
    Record,
    SyncDelta,
    SyncDigest,
    Update,
    record_signing_bytes,
)
from mesh.sync import BUCKETS, MAX_BUCKET_BITS, bucket_of, digest_bits, fold, member_fingerprint
from tests.mesh.test_membership import CONFIG, Net, identity
from tests.mesh.test_membership_trust import alive, dead, say, suspect

MEMBERS = [identity(f"member-{i}") for i in range(10)]
"""Third parties the two cores hold views of (never running themselves)."""

ACCUSERS = [identity(f"accuser-{i}") for i in range(2)]
"""Members that accuse others and are never accused: who accuses must be
alive in the receiver's view, so this keeps every accusation admissible
whatever order the merges come in."""


def record(who: Identity, seq: int) -> Record:
    body = b"{}"
    return Record(who.node_id, seq, body, who.sign(record_signing_bytes(who.node_id, seq, body)))


def member_updates(who: Identity, version: tuple[int, str, int]) -> list[Update]:
    """Signed updates that bring a core to `version` = (incarnation, state,
    record seq) of member `who`; state "alive", "suspect" or "dead"."""
    incarnation, state, seq = version
    addr = f"tcp://{who.node_id.hex()[:8]}"
    updates: list[Update] = [alive(who, incarnation, addr)]
    if state == "suspect":
        updates.append(suspect(ACCUSERS[0], who.node_id, incarnation))
    elif state == "dead":
        updates.append(dead(ACCUSERS[1], who.node_id, incarnation))
    if seq:
        updates.append(record(who, seq))
    return updates


versions = st.tuples(
    st.integers(0, 3), st.sampled_from(["alive", "suspect", "dead"]), st.integers(0, 3)
)
views = st.lists(st.one_of(st.none(), versions), min_size=len(MEMBERS), max_size=len(MEMBERS))


def two_cores(
    view_a: list[tuple[int, str, int] | None], view_b: list[tuple[int, str, int] | None]
) -> Net:
    """Cores "a" and "b", joined, each then told its own view of MEMBERS
    (None: never heard of that member)."""
    net = Net("a", "b")
    net.join_all()
    # Third parties answer pings, so each core verifies them as members.
    net.outsiders = {who.node_id: who for who in (*MEMBERS, *ACCUSERS)}
    for name in ("a", "b"):
        say(
            net,
            net.ids["b" if name == "a" else "a"],
            name,
            Gossip(tuple(alive(who, 0, "tcp://x") for who in ACCUSERS)),
        )
        net.answer_outsiders(name)
    for name, view in (("a", view_a), ("b", view_b)):
        teller = net.ids["b" if name == "a" else "a"]
        for who, version in zip(MEMBERS, view, strict=True):
            if version is not None:
                first, *rest = member_updates(who, version)
                say(net, teller, name, Gossip((first,)))
                net.answer_outsiders(name)
                say(net, teller, name, Gossip(tuple(rest)))
    for node in net.nodes.values():
        node.take_sends()  # what the telling made them gossip: not part of the sync
    return net


def table(node: Membership) -> dict[bytes, tuple[int, str, int | None]]:
    """Every member as (incarnation, state, record seq)."""
    return {
        view.node: (
            view.incarnation,
            view.state.value,
            None if view.record is None else view.record.seq,
        )
        for view in node.members()
    }


def sync(net: Net, initiator: str, peer: str) -> list[str]:
    """One delta sync, no loss; the names of the messages it took."""
    sent: list[str] = []
    keep = net.keep

    def note(send: object) -> bool:
        sent.append(type(send.envelope.message).__name__)  # type: ignore[attr-defined]
        return keep(send)  # type: ignore[arg-type]

    net.keep = note
    target = net.nodes[peer]
    net.nodes[initiator]._start_sync(target.node_id, target.addr)
    net.deliver()
    net.keep = keep
    return sent


def full_push_pull(net: Net, initiator: str, peer: str) -> None:
    """The full-state exchange a delta sync replaces, no loss."""
    source = net.nodes[initiator]
    state = source._full_state(join=False, reply=False)
    net.nodes[peer].receive(Envelope(source.node_id, source.addr, state), net.now)
    net.deliver()


def digest(node: Membership) -> tuple[int, ...]:
    return node._table.digest(MAX_BUCKET_BITS)


# --- convergence ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(view_a=views, view_b=views)
def test_one_delta_sync_leaves_two_tables_identical(
    view_a: list[tuple[int, str, int] | None], view_b: list[tuple[int, str, int] | None]
) -> None:
    """Whatever the two views of suspicions and records, after one sync both
    hold every member alike, and so have equal digests. Deaths are left out
    here: a death heard in a sync becomes the hearer's own suspicion, by
    design (see the next test)."""
    view_a = [
        None if v is None else (v[0], "alive" if v[1] == "dead" else v[1], v[2]) for v in view_a
    ]
    view_b = [
        None if v is None else (v[0], "alive" if v[1] == "dead" else v[1], v[2]) for v in view_b
    ]
    net = two_cores(view_a, view_b)
    sync(net, "a", "b")
    a, b = net.nodes["a"], net.nodes["b"]
    assert table(a) == table(b)
    assert digest(a) == digest(b)


@settings(max_examples=60, deadline=None)
@given(view_a=views, view_b=views)
def test_a_delta_sync_ends_where_a_full_push_pull_ends(
    view_a: list[tuple[int, str, int] | None], view_b: list[tuple[int, str, int] | None]
) -> None:
    """The same two cores, one synced by delta and one copy by a full
    exchange, end with the same views: a delta leaves out only what both
    already hold alike. Deaths included (each side turns the other's into
    its own suspicion)."""
    net, twin = two_cores(view_a, view_b), two_cores(view_a, view_b)
    sync(net, "a", "b")
    full_push_pull(twin, "a", "b")
    for name in ("a", "b"):
        assert table(net.nodes[name]) == table(twin.nodes[name])


@given(view=views)
@settings(max_examples=30, deadline=None)
def test_tables_that_agree_trade_one_digest_and_nothing_more(
    view: list[tuple[int, str, int] | None],
) -> None:
    net = two_cores(view, view)
    sync(net, "a", "b")  # the accusers' and each other's entries may differ at first
    assert sync(net, "b", "a") == ["SyncDigest"]


def test_the_digest_is_kept_current_through_every_change() -> None:
    """A table's running digest equals one computed from scratch, after
    joins, suspicions, deaths, refutations, records and forgetting."""
    net = Net("a", "b", "c")
    net.join_all()
    net.nodes["c"].publish_record(b'{"v": 2}', net.now)
    net.keep = lambda send: net.name_of(send.addr) != "c"
    net.advance(CONFIG.suspicion_max_timeout(3) + 5)  # c is declared dead
    net.keep = lambda send: True
    net.advance(CONFIG.reconnect_interval * 3)  # and refutes after the heal
    for node in net.nodes.values():
        fresh = [0] * BUCKETS
        for view in node.members():
            entry = node._table.get(view.node)
            fresh[view.node[0]] ^= member_fingerprint(entry.alive, entry.accusation, view.record)
        assert digest(node) == tuple(fresh)
    a = net.nodes["a"]
    a._table.forget(net.ids["c"].node_id)
    fresh = [0] * BUCKETS
    for view in a.members():
        entry = a._table.get(view.node)
        fresh[view.node[0]] ^= member_fingerprint(entry.alive, entry.accusation, view.record)
    assert digest(a) == tuple(fresh)


def test_digests_fold_by_the_first_bits_of_member_ids() -> None:
    fine = list(range(1, BUCKETS + 1))
    assert fold(fine, MAX_BUCKET_BITS) == tuple(fine)
    halves = fold(fine, 1)
    assert len(halves) == 2
    assert halves[0] == sum_xor(fine[: BUCKETS // 2]) and halves[1] == sum_xor(fine[BUCKETS // 2 :])
    assert fold(fine, 0) == (sum_xor(fine),)
    assert bucket_of(bytes([0b1011_0000]) + bytes(31), 1) == 1
    assert bucket_of(bytes([0b1011_0000]) + bytes(31), 4) == 0b1011
    assert digest_bits(1) == 0 and digest_bits(40) == 4 and digest_bits(10**6) == MAX_BUCKET_BITS


def sum_xor(values: list[int]) -> int:
    total = 0
    for value in values:
        total ^= value
    return total


# --- refusals --------------------------------------------------------------------------


def test_malformed_digests_and_deltas_are_counted_and_the_node_keeps_running() -> None:
    net = Net("a", "b")
    net.join_all()
    b = net.ids["b"]
    a = net.nodes["a"]
    member = alive(MEMBERS[0], 0, "tcp://m")
    outside = (member.node[0] >> 4) ^ 1  # a bucket at 4 bits that does not hold it
    malformed = [
        SyncDigest(()),
        SyncDigest((0, 0, 0)),
        SyncDigest((0,) * (2 * BUCKETS)),  # oversized: more buckets than ids have
        SyncDelta(False, MAX_BUCKET_BITS + 1, (0,), (), ()),
        SyncDelta(False, 4, (), (member,), ()),
        SyncDelta(False, 4, (outside,), (member,), ()),
        SyncDelta(False, 4, (3, 2), (), ()),
        SyncDelta(False, 4, (16,), (), ()),
        SyncDelta(True, 4, (), (member,), ()),
    ]
    for count, message in enumerate(malformed, start=1):
        say(net, b, "a", message)
        assert a.drops[R_SYNC_MALFORMED] == count, message
    assert a.member(member.node) is None  # nothing in them was taken
    assert a.take_sends() == []  # nor answered
    net.advance(CONFIG.push_pull_period(2) * 2)  # and the node still works
    assert sync(net, "a", "b")[0] == "SyncDigest"
    assert net.nodes["b"].drops[R_SYNC_MALFORMED] == 0


def test_joins_still_trade_the_full_state() -> None:
    """A joiner has nothing to compare: its join and the seed's answer are
    full push-pulls, whatever the seed holds."""
    net = Net("seed", "joiner")
    seed, joiner = net.nodes["seed"], net.nodes["joiner"]
    joiner.join([(seed.node_id, seed.addr)], net.now)
    (ask,) = joiner.take_sends()
    assert isinstance(ask.envelope.message, PushPull) and not ask.envelope.message.reply
    seed.receive(ask.envelope, net.now)
    # Beside its answer, the seed pings the joiner: a new id is a member
    # only once it answers (docs/design/membership.md#introductions).
    answers = [s.envelope.message for s in seed.take_sends()]
    assert [type(m) for m in answers] == [Ping, PushPull] and answers[1].reply  # type: ignore[union-attr]


def test_a_sync_where_one_member_differs_carries_its_bucket_not_the_table() -> None:
    net = two_cores([(1, "alive", 1)] * len(MEMBERS), [(1, "alive", 1)] * len(MEMBERS))
    sync(net, "a", "b")  # agree, and a's latest changes are sent
    say(net, net.ids["a"], "b", Gossip((alive(MEMBERS[3], 2, "tcp://m3"),)))
    net.nodes["b"].take_sends()
    deltas: list[SyncDelta] = []
    keep = net.keep

    def watch(send: object) -> bool:
        message = send.envelope.message  # type: ignore[attr-defined]
        if isinstance(message, SyncDelta):
            deltas.append(message)
        return keep(send)  # type: ignore[arg-type]

    net.keep = watch
    target = net.nodes["b"]
    net.nodes["a"]._start_sync(target.node_id, target.addr)
    net.deliver()
    assert len(deltas) == 1  # b's state for one bucket, and a had nothing b lacked
    assert MEMBERS[3].node_id in {update.node for update in deltas[0].states}
    assert len(deltas[0].states) < len(MEMBERS)
    assert table(net.nodes["a"]) == table(net.nodes["b"])


def test_the_latest_changes_ride_on_the_digest() -> None:
    """A refutation the responder missed reaches it with the digest, in one
    message, as a full push would have carried it."""
    net = two_cores([(1, "alive", 0)] * len(MEMBERS), [(1, "alive", 0)] * len(MEMBERS))
    sync(net, "a", "b")
    say(net, net.ids["b"], "a", Gossip((alive(MEMBERS[5], 2, "tcp://m5"),)))
    net.nodes["a"].take_sends()
    net.keep = lambda send: isinstance(send.envelope.message, SyncDigest)
    target = net.nodes["b"]
    net.nodes["a"]._start_sync(target.node_id, target.addr)
    net.deliver()
    assert table(net.nodes["b"])[MEMBERS[5].node_id][0] == 2


def test_members_hash_the_same_whoever_accused_them() -> None:
    who = MEMBERS[0]
    one = member_fingerprint(alive(who, 1, "tcp://x"), suspect(ACCUSERS[0], who.node_id, 1), None)
    other = member_fingerprint(alive(who, 1, "tcp://x"), suspect(ACCUSERS[1], who.node_id, 1), None)
    assert one == other
    states = [
        member_fingerprint(alive(who, inc, "tcp://x"), accusation, None)
        for inc, accusation in itertools.product(
            (1, 2),
            (
                None,
                suspect(ACCUSERS[0], who.node_id, 1),
                dead(ACCUSERS[0], who.node_id, 1),
                dead(who, who.node_id, 1),
            ),
        )
    ]
    assert len(set(states)) == len(states)


def test_a_member_gone_past_the_reconnect_timeout_is_forgotten() -> None:
    """Forgetting reads the table only once a gone member may be due; it
    must still forget exactly those gone longer than `reconnect_timeout`.
    (With a third member still holding the gone one, a sync would teach it
    back: a full push-pull did the same.)"""
    config = CONFIG.with_overrides(reconnect_timeout=40.0, push_pull_interval=5.0)
    net = Net("a", "c", config=config)
    net.join_all()
    c = net.ids["c"].node_id
    net.nodes["c"].leave(net.now)
    net.deliver()
    del net.nodes["c"]
    assert net.state("a", "c") is MemberState.LEFT
    net.advance(30.0)
    assert net.nodes["a"].member(c) is not None  # gone, but not for long enough
    net.advance(20.0)
    assert net.nodes["a"].member(c) is None
