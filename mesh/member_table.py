"""The membership core's storage: who we know, their records, and whom to
probe next.

A table may start from a shared read-only `StartingView`, copied entry by
entry only when an entry changes (the simulator starts 10,000 cores from one
view). It also keeps its delta-sync digest (`mesh.sync`) up to date: so an
entry's Alive and accusation change only through `restate`, and a record
only through `set_record`. Details: docs/design/membership.md#the-member-table.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal, get_args

from mesh.identity import Verifier
from mesh.messages import Alive, Dead, Record, Suspect, signer_of, signing_bytes
from mesh.sync import (
    BUCKETS,
    MAX_RECENT,
    bucket_of,
    fine_bucket,
    fine_range,
    fold,
    member_fingerprint,
)


class MemberState(StrEnum):
    """What membership believes of a member (SWIM with Lifeguard)."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


MemberStateName = Literal["alive", "suspect", "dead", "left"]
"""A `MemberState` as plain text: how consensus, the status API and the
simulator's oracles see a state. A `MemberState` is a str equal to its name,
so ``state in LIVE_STATES`` holds alike for either."""

MEMBER_STATES: Final[frozenset[MemberState]] = frozenset(MemberState)
"""Every state; a name outside it is a bug or a forgery."""

LIVE_STATES: Final[frozenset[MemberState]] = frozenset({MemberState.ALIVE, MemberState.SUSPECT})
"""Members that still count: membership probes them and counts them in the
swarm size its timeouts scale with, and they serve their shard (coverage,
placement). A suspect node counts: suspicion is not yet death, Lifeguard's refutation
clears most suspicions within a probe round or two, and dropping suspects
would punch transient gaps into coverage (and trigger needless placement) on
every lost packet. Routes may still rank suspects lower."""

GONE_STATES: Final[frozenset[MemberState]] = MEMBER_STATES - LIVE_STATES
"""Dead or left: members that neither serve nor are probed."""

_STATE_NAMES: Final[Mapping[MemberState, MemberStateName]] = {
    MemberState.ALIVE: "alive",
    MemberState.SUSPECT: "suspect",
    MemberState.DEAD: "dead",
    MemberState.LEFT: "left",
}
# MemberStateName must name exactly MemberState's states (checked on import).
if set(get_args(MemberStateName)) != MEMBER_STATES or set(_STATE_NAMES) != MEMBER_STATES:
    raise AssertionError("MemberStateName, _STATE_NAMES and MemberState must list the same states")


def state_name(state: MemberState) -> MemberStateName:
    """`state` as its `MemberStateName` (equal to it, but typed as the Literal),
    for consensus (`consensus.voters.MemberInfo`, `consensus.placement.node_view`)."""
    return _STATE_NAMES[state]


class MemberEntry:
    """Everything one node believes about one member (mutable, owned by one
    table). When it was last heard from is kept by the table (`seen`), not
    here: a successful probe then costs no copy of a shared entry."""

    __slots__ = (
        "accusation",
        "addr",
        "alive",
        "incarnation",
        "node",
        "state",
        "state_since",
    )

    def __init__(self, alive: Alive, now: float) -> None:
        self.node = alive.node
        self.addr = alive.addr
        self.incarnation = alive.incarnation
        self.alive = alive
        self.accusation: Suspect | Dead | None = None
        self.state = MemberState.ALIVE
        self.state_since = now

    def clone(self) -> MemberEntry:
        # Field by field, not by walking __slots__: mypyc (simulations.compiled)
        # compiles this class, and a compiled class has no __slots__ to walk.
        twin = MemberEntry(self.alive, self.state_since)
        twin.addr = self.addr
        twin.incarnation = self.incarnation
        twin.accusation = self.accusation
        twin.state = self.state
        return twin


@dataclass(frozen=True, slots=True)
class StartingView:
    """A swarm state that many membership cores can start from, unchanged.

    `digest` is its delta-sync digest per fine bucket and `by_bucket` its
    members per fine bucket, in `nodes` order (`mesh.sync`); `build` fills
    them in."""

    members: Mapping[bytes, MemberEntry]
    nodes: Sequence[bytes]
    records: Mapping[bytes, Record]
    digest: Sequence[int]
    by_bucket: Sequence[Sequence[bytes]]

    @classmethod
    def build(
        cls,
        alives: Iterable[Alive],
        records: Iterable[Record],
        now: float,
        verifier: Verifier,
    ) -> StartingView:
        """Check every signature once, for all the cores that will share it."""
        members: dict[bytes, MemberEntry] = {}
        for alive in alives:
            if verifier(signer_of(alive), signing_bytes(alive), alive.signature):
                members[alive.node] = MemberEntry(alive, now)
        kept = {
            r.node: r
            for r in records
            if r.node in members and verifier(r.node, signing_bytes(r), r.signature)
        }
        digest = [0] * BUCKETS
        by_bucket: list[list[bytes]] = [[] for _ in range(BUCKETS)]
        for node, entry in members.items():
            fine = fine_bucket(node)
            digest[fine] ^= member_fingerprint(entry.alive, None, kept.get(node))
            by_bucket[fine].append(node)
        return cls(members, tuple(members), kept, tuple(digest), tuple(map(tuple, by_bucket)))


_EMPTY_VIEW = StartingView({}, (), {}, (0,) * BUCKETS, ((),) * BUCKETS)


class MemberTable:
    """Members and records by node id; our own entries over a shared base."""

    def __init__(self, self_id: bytes, start: StartingView | None = None) -> None:
        self.self_id = self_id
        base = start or _EMPTY_VIEW
        self._base = base.members
        self._base_nodes = base.nodes
        self._base_records = base.records
        self._own: dict[bytes, MemberEntry] = {}
        self._own_records: dict[bytes, Record] = {}
        self._extra_nodes: list[bytes] = []  # members not in the base, in join order
        self._extra_index: dict[bytes, int] = {}
        self._forgotten: set[bytes] = set()
        self._by_bucket = base.by_bucket
        self._digest = array("q", base.digest)
        self._changed: dict[bytes, None] = {}  # most recently changed last
        self._last_seen: dict[bytes, float] = {}

    # --- members ------------------------------------------------------------

    def get(self, node: bytes) -> MemberEntry | None:
        entry = self._own.get(node)
        if entry is not None or node in self._forgotten:
            return entry
        return self._base.get(node)

    def entry(self, node: bytes) -> MemberEntry:
        """The entry for a node the table holds (a peer `random_peer` drew);
        KeyError for any other."""
        entry = self.get(node)
        if entry is None:
            raise KeyError(node)
        return entry

    def own(self, entry: MemberEntry) -> MemberEntry:
        """This table's own, writable copy of `entry` (one `get` returned):
        itself when it is already ours, else a copy out of the shared base."""
        mine = self._own.get(entry.node)
        if mine is None:
            mine = entry.clone()
            self._own[entry.node] = mine
        return mine

    def add(self, entry: MemberEntry) -> None:
        """Hold `entry` as the member `entry.node`, in place of any entry
        for that node."""
        node = entry.node
        record = self.record(node)
        previous = self.get(node)
        change = member_fingerprint(entry.alive, entry.accusation, record)
        if previous is not None:
            change ^= member_fingerprint(previous.alive, previous.accusation, record)
        self._digest[fine_bucket(node)] ^= change
        self._note_change(node)
        self._own[node] = entry
        if node in self._forgotten:
            self._forgotten.discard(node)
        elif node not in self._base and node not in self._extra_index:
            self._extra_index[node] = len(self._extra_nodes)
            self._extra_nodes.append(node)

    def restate(self, entry: MemberEntry, alive: Alive, accusation: Suspect | Dead | None) -> None:
        """Give `entry` (this table's own: see `own`) a new Alive and
        accusation, keeping the digest up to date."""
        before = entry.alive.fingerprint()
        if entry.accusation is not None:
            before ^= entry.accusation.fingerprint()
        after = alive.fingerprint()
        if accusation is not None:
            after ^= accusation.fingerprint()
        self._digest[fine_bucket(entry.node)] ^= before ^ after
        self._note_change(entry.node)
        entry.alive = alive
        entry.accusation = accusation

    def forget(self, node: bytes) -> None:
        entry = self.get(node)
        if entry is not None:
            record = self.record(node)
            self._digest[fine_bucket(node)] ^= member_fingerprint(
                entry.alive, entry.accusation, record
            )
        self._own.pop(node, None)
        self._own_records.pop(node, None)
        self._last_seen.pop(node, None)
        self._changed.pop(node, None)
        if node in self._base:
            self._forgotten.add(node)
            return
        index = self._extra_index.pop(node, None)
        if index is None:
            return
        last = self._extra_nodes.pop()
        if last != node:
            self._extra_nodes[index] = last
            self._extra_index[last] = index

    def __iter__(self) -> Iterator[MemberEntry]:
        yield from self._own.values()
        for node, entry in self._base.items():
            if node not in self._own and node not in self._forgotten:
                yield entry

    def initial_live_count(self) -> int:
        """Members alive at the start (all of a starting view's are)."""
        return len(self._base)

    # --- records ------------------------------------------------------------

    def record(self, node: bytes) -> Record | None:
        record = self._own_records.get(node)
        if record is not None or node in self._forgotten:
            return record
        return self._base_records.get(node)

    def set_record(self, record: Record) -> None:
        node = record.node
        if self.get(node) is not None:
            previous = self.record(node)
            change = record.fingerprint()
            if previous is not None:
                change ^= previous.fingerprint()
            self._digest[fine_bucket(node)] ^= change
            self._note_change(node)
        self._own_records[node] = record

    def records(self) -> Iterator[Record]:
        yield from self._own_records.values()
        for node, record in self._base_records.items():
            if node not in self._own_records and node not in self._forgotten:
                yield record

    # --- liveness -----------------------------------------------------------

    def seen(self, node: bytes, now: float) -> None:
        """`node` answered us at `now` (a probe's ack)."""
        self._last_seen[node] = now

    def last_seen(self, node: bytes) -> float | None:
        return self._last_seen.get(node)

    # --- delta sync (mesh.sync) ----------------------------------------------

    def digest(self, bits: int) -> tuple[int, ...]:
        """The table's digest at `bits` bucket bits."""
        return fold(self._digest, bits)

    def _note_change(self, node: bytes) -> None:
        changed = self._changed
        changed.pop(node, None)
        changed[node] = None
        if len(changed) > MAX_RECENT:
            del changed[next(iter(changed))]

    def take_changed(self) -> list[MemberEntry]:
        """The members changed most recently (at most `MAX_RECENT`, oldest
        change first), forgetting them: the next call names only later ones."""
        changed, self._changed = self._changed, {}
        return [entry for entry in map(self.get, changed) if entry is not None]

    def fingerprint(self, entry: MemberEntry) -> int:
        """The member fingerprint of `entry`, one of this table's."""
        return member_fingerprint(entry.alive, entry.accusation, self.record(entry.node))

    def in_buckets(self, bits: int, buckets: Collection[int]) -> Iterator[MemberEntry]:
        """Every member in `buckets` (at `bits` bucket bits), in a fixed
        order: the starting view's by bucket, then those learned since."""
        by_bucket = self._by_bucket
        for bucket in buckets:
            for fine in fine_range(bucket, bits):
                for node in by_bucket[fine]:
                    entry = self.get(node)
                    if entry is not None:
                        yield entry
        if self._extra_nodes:
            wanted = set(buckets)
            for node in self._extra_nodes:
                if bucket_of(node, bits) in wanted:
                    entry = self.get(node)
                    if entry is not None:
                        yield entry

    # --- random choice ------------------------------------------------------

    @property
    def slots(self) -> int:
        """Positions `node_at` accepts; some hold us or forgotten members."""
        return len(self._base_nodes) + len(self._extra_nodes)

    def node_at(self, position: int) -> bytes | None:
        """The peer at `position`, or None where that slot is us or forgotten."""
        base = len(self._base_nodes)
        node = self._base_nodes[position] if position < base else self._extra_nodes[position - base]
        if node == self.self_id or node in self._forgotten:
            return None
        return node

    def random_peer(self, rng: random.Random) -> bytes | None:
        slots = self.slots
        return self.node_at(rng.randrange(slots)) if slots else None


class ProbeOrder:
    """Round-robin over all peers in a fresh random order each cycle.

    Round-robin bounds the time until any member is probed (two cycles at
    worst), which pure random choice does not. The order is an affine
    permutation of table positions, (a * k + b) mod n with a random `a`
    coprime to n, so a cycle costs O(1) memory however large the swarm.
    Members that join mid-cycle wait in `newcomers` and are drawn at random
    points of the rest of the cycle, as if inserted at a random position.
    """

    def __init__(self, table: MemberTable, rng: random.Random) -> None:
        self._table = table
        self._rng = rng
        self._size = 0
        self._step = 1
        self._offset = 0
        self._next = 0
        self._newcomers: list[bytes] = []

    def _new_cycle(self) -> None:
        self._size = self._table.slots
        self._next = 0
        self._newcomers.clear()
        if self._size == 0:
            return
        self._offset = self._rng.randrange(self._size)
        step = self._rng.randrange(1, self._size + 1)
        while math.gcd(step, self._size) != 1:
            step = step % self._size + 1
        self._step = step

    def joined(self, node: bytes) -> None:
        """`node` is new to the table: give it a place in this cycle."""
        self._newcomers.append(node)

    def next_candidate(self) -> bytes | None:
        """The next peer to consider probing, or None if a cycle's slot is empty."""
        remaining = self._size - self._next
        if remaining <= 0 and not self._newcomers:
            self._new_cycle()
            remaining = self._size
            if remaining == 0:
                return None
        pending = len(self._newcomers)
        if pending and self._rng.randrange(remaining + pending) < pending:
            return self._newcomers.pop(self._rng.randrange(pending))
        position = (self._step * self._next + self._offset) % self._size
        self._next += 1
        return self._table.node_at(position)

    def cycle_length(self) -> int:
        return self._size + len(self._newcomers)
