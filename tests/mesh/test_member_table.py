"""The membership core's storage (`mesh.member_table`): a table over a
shared starting view copies an entry only when it changes, keeps its
delta-sync digest equal to a fold of its members' fingerprints through every
change, and probes every peer once per round-robin cycle."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mesh.identity import Identity, verify
from mesh.member_table import (
    GONE_STATES,
    LIVE_STATES,
    MemberEntry,
    MemberState,
    MemberTable,
    ProbeOrder,
    StartingView,
    state_name,
)
from mesh.messages import (
    Alive,
    Dead,
    Record,
    Suspect,
    alive_signing_bytes,
    record_signing_bytes,
    suspect_signing_bytes,
)
from mesh.sync import BUCKETS, MAX_RECENT, fine_bucket, fold, member_fingerprint

PEOPLE = [Identity.from_seed(f"table-{i}".encode().ljust(32, b".")) for i in range(12)]
ME = PEOPLE[0]


def alive(who: Identity, incarnation: int = 0) -> Alive:
    addr = f"tcp://{who.node_id.hex()[:6]}"
    return Alive(
        who.node_id,
        incarnation,
        addr,
        who.sign(alive_signing_bytes(who.node_id, incarnation, addr)),
    )


def suspect(by: Identity, node: bytes, incarnation: int = 0) -> Suspect:
    signature = by.sign(suspect_signing_bytes(node, incarnation, by.node_id))
    return Suspect(node, incarnation, by.node_id, signature)


def record(who: Identity, seq: int = 1) -> Record:
    body = b"{}"
    return Record(who.node_id, seq, body, who.sign(record_signing_bytes(who.node_id, seq, body)))


def expected_digest(table: MemberTable) -> tuple[int, ...]:
    """The digest worked out from scratch, member by member."""
    fine = [0] * BUCKETS
    for entry in table:
        fine[fine_bucket(entry.node)] ^= member_fingerprint(
            entry.alive, entry.accusation, table.record(entry.node)
        )
    return fold(fine, 8)


def view(people: list[Identity]) -> StartingView:
    return StartingView.build(
        [alive(p) for p in people], [record(p) for p in people], now=0.0, verifier=verify
    )


def test_state_names_and_sets() -> None:
    assert {state_name(s) for s in MemberState} == {"alive", "suspect", "dead", "left"}
    assert {MemberState.ALIVE, MemberState.SUSPECT} == LIVE_STATES
    assert {MemberState.DEAD, MemberState.LEFT} == GONE_STATES


def test_a_starting_view_keeps_only_what_its_signatures_prove() -> None:
    forged = Alive(PEOPLE[5].node_id, 0, "tcp://x", b"\x00" * 64)
    stray = record(PEOPLE[6])  # a record of someone not in the view
    bad_record = Record(PEOPLE[1].node_id, 2, b"{}", b"\x00" * 64)
    built = StartingView.build(
        [alive(PEOPLE[1]), forged], [record(PEOPLE[1], 1), stray, bad_record], 0.0, verify
    )
    assert set(built.members) == {PEOPLE[1].node_id}
    assert set(built.records) == {PEOPLE[1].node_id}
    assert built.records[PEOPLE[1].node_id].seq == 1
    table = MemberTable(ME.node_id, built)
    assert table.digest(8) == expected_digest(table)
    assert table.initial_live_count() == 1


def test_a_shared_view_is_copied_only_where_an_entry_changes() -> None:
    shared = view(PEOPLE[1:6])
    one, two = MemberTable(ME.node_id, shared), MemberTable(PEOPLE[1].node_id, shared)
    target = PEOPLE[2].node_id
    base_entry = one.entry(target)
    mine = one.own(base_entry)
    assert mine is not base_entry and one.own(mine) is mine
    one.restate(mine, mine.alive, suspect(PEOPLE[3], target))
    mine.state = MemberState.SUSPECT
    assert one.entry(target).state is MemberState.SUSPECT
    assert two.entry(target) is base_entry and base_entry.state is MemberState.ALIVE
    assert shared.members[target].accusation is None
    assert one.digest(8) == expected_digest(one) != two.digest(8)
    assert two.digest(8) == expected_digest(two)


def test_the_digest_follows_every_change() -> None:
    table = MemberTable(ME.node_id, view(PEOPLE[1:4]))
    table.add(MemberEntry(alive(PEOPLE[7]), 1.0))  # a member learned since
    assert table.digest(8) == expected_digest(table)
    table.set_record(record(PEOPLE[7], 3))
    assert table.digest(8) == expected_digest(table)
    table.set_record(record(PEOPLE[1], 5))  # replaces the view's seq 1
    assert (renewed := table.record(PEOPLE[1].node_id)) is not None and renewed.seq == 5
    assert table.digest(8) == expected_digest(table)
    entry = table.own(table.entry(PEOPLE[2].node_id))
    table.restate(entry, alive(PEOPLE[2], 1), None)  # a refutation
    assert table.digest(8) == expected_digest(table)
    table.add(MemberEntry(alive(PEOPLE[3], 4), 2.0))  # in place of the view's entry
    assert table.digest(8) == expected_digest(table)
    for gone in (PEOPLE[1].node_id, PEOPLE[7].node_id):
        table.forget(gone)
        assert table.get(gone) is None and table.record(gone) is None
        assert table.digest(8) == expected_digest(table)
    assert {e.node for e in table} == {PEOPLE[2].node_id, PEOPLE[3].node_id}
    assert {r.node for r in table.records()} == {PEOPLE[2].node_id, PEOPLE[3].node_id}
    table.add(MemberEntry(alive(PEOPLE[8]), 3.0))  # a new member after a forget
    assert table.digest(8) == expected_digest(table)
    assert table.slots == 4  # three from the view, one learned: 7's slot was reused


def test_a_record_before_its_member_counts_only_once_the_member_is_known() -> None:
    table = MemberTable(ME.node_id)
    empty = table.digest(8)
    table.set_record(record(PEOPLE[4]))
    assert table.digest(8) == empty
    table.add(MemberEntry(alive(PEOPLE[4]), 0.0))
    assert table.digest(8) == expected_digest(table) != empty


def test_recent_changes_are_taken_once_newest_last_and_bounded() -> None:
    table = MemberTable(ME.node_id)
    people = [Identity.from_seed(bytes([i]) * 32) for i in range(1, MAX_RECENT + 4)]
    for person in people:
        table.add(MemberEntry(alive(person), 0.0))
    first = people[0]
    table.set_record(record(first))  # changed again: now the most recent
    changed = [entry.node for entry in table.take_changed()]
    assert len(changed) == MAX_RECENT
    assert changed[-1] == first.node_id
    assert changed[:-1] == [p.node_id for p in people[-(MAX_RECENT - 1) :]]
    assert table.take_changed() == []


def test_in_buckets_lists_exactly_the_members_of_those_buckets() -> None:
    table = MemberTable(ME.node_id, view(PEOPLE[1:8]))
    table.add(MemberEntry(alive(PEOPLE[9]), 0.0))
    table.add(MemberEntry(alive(PEOPLE[10]), 0.0))
    for bits in (1, 2, 4):
        seen: Counter[bytes] = Counter()
        for bucket in range(1 << bits):
            for entry in table.in_buckets(bits, [bucket]):
                assert entry.node[0] >> (8 - bits) == bucket
                seen[entry.node] += 1
        assert seen == Counter(e.node for e in table)


def test_liveness_and_random_peers_never_name_us_or_the_forgotten() -> None:
    table = MemberTable(ME.node_id, view(PEOPLE[:4]))  # the view holds us too
    table.seen(PEOPLE[1].node_id, 7.5)
    assert table.last_seen(PEOPLE[1].node_id) == 7.5
    assert table.last_seen(PEOPLE[2].node_id) is None
    table.forget(PEOPLE[1].node_id)
    assert table.last_seen(PEOPLE[1].node_id) is None
    rng = random.Random(1)
    drawn = {table.random_peer(rng) for _ in range(200)}
    assert drawn == {None, PEOPLE[2].node_id, PEOPLE[3].node_id}
    assert MemberTable(ME.node_id).random_peer(rng) is None
    with pytest.raises(KeyError):
        table.entry(PEOPLE[1].node_id)


def test_every_peer_is_probed_once_per_cycle_and_a_joiner_within_it() -> None:
    table = MemberTable(ME.node_id, view(PEOPLE[:9]))
    peers = sorted(p.node_id for p in PEOPLE[1:9])
    order = ProbeOrder(table, random.Random(3))
    orders = []
    for _ in range(3):  # each cycle from its first call names every peer once
        first = order.next_candidate()  # starts the cycle
        cycle = [first, *(order.next_candidate() for _ in range(order.cycle_length() - 1))]
        assert sorted(n for n in cycle if n is not None) == peers
        assert cycle.count(None) == 1  # our own slot
        orders.append(cycle)
    assert len({tuple(c) for c in orders}) > 1  # a fresh order each cycle
    # A member that joins mid-cycle is drawn before the cycle ends.
    order = ProbeOrder(table, random.Random(5))
    order.next_candidate()
    joiner = PEOPLE[11]
    table.add(MemberEntry(alive(joiner), 0.0))
    order.joined(joiner.node_id)
    remaining = order.cycle_length() - 1
    assert joiner.node_id in [order.next_candidate() for _ in range(remaining)]


def test_an_empty_table_has_nobody_to_probe() -> None:
    order = ProbeOrder(MemberTable(ME.node_id), random.Random(0))
    assert order.next_candidate() is None
    assert order.cycle_length() == 0


def test_clone_copies_every_field() -> None:
    entry = MemberEntry(alive(PEOPLE[1]), 4.0)
    entry.accusation = Dead(PEOPLE[1].node_id, 0, PEOPLE[2].node_id, b"\x00" * 64)
    entry.state = MemberState.DEAD
    entry.addr = "tcp://moved"
    twin = entry.clone()
    assert twin is not entry
    assert [getattr(twin, f) for f in MemberEntry.__slots__] == [
        getattr(entry, f) for f in MemberEntry.__slots__
    ]
