"""Delta sync: two members find what they hold differently without trading it all.

SWIM's periodic push-pull (memberlist's, and ours before this module) has
each side send its whole member table and merge every entry of the other's:
O(N) work and bytes per sync, every sync, though two healthy members almost
always agree on every entry. With a sync every push-pull period at every
node, a 10,000-node swarm spent most of its membership work merging entries
it already held. A delta sync finds the differences first:

1. the initiator sends a digest: its table folded into 2**k buckets by the
   first k bits of each member's id, each bucket the XOR of its members'
   fingerprints, and its state for the few members it changed most
   recently (`SyncDigest`);
2. the other side merges those, then folds its own table the same way;
   where every bucket agrees it stops there (the usual case). Otherwise it
   sends its state for every member it holds in the buckets that differ
   (`SyncDelta`);
3. the initiator merges what differs from its own and sends back its state
   for the members of those buckets that the other holds differently or
   not at all (`SyncDelta`, a reply, never answered).

What is merged is what a full push-pull would have changed, less the
entries both sides already hold identically; merging goes through the same
checks (signatures, accusers, a death heard second-hand becoming our own
suspicion, newcomer limits). Three messages where a push-pull takes two:
the initiator has the other side's news after two, as before, but the
other side would have the initiator's only after three, and each message
lost (10% loss is a design point) is a sync that repairs nothing. The
repair that matters most is of a member that missed a refutation and will
otherwise declare a live node dead when its suspicion runs out; that
refutation is among the most recent changes of nearly everyone else, so
step one carries those, and a member hears them in one message, as it
would from a full push. (The 50-node, 10%-loss runs of
tests/simulations/test_cluster.py showed false verdicts without this.) Joins
and strangers still get a full `PushPull`: a joiner has nothing to compare.

A member's fingerprint is the XOR of the fingerprints of its Alive, its
accusation (suspect, dead or left at an incarnation, whoever accused) and
its record (`mesh.messages`); each is a 63-bit BLAKE2b of the claim, so two
tables that differ leave a bucket's XOR unchanged with probability 2**-63.
Each table keeps the XOR per fine bucket up to date as entries change
(`mesh.member_table`), so a digest costs 256 XORs, not a pass over the
table. A Byzantine member can shape only the fingerprints of its own
entries; making two honest tables look equal in a bucket they disagree on
takes a 2**63 search per attempt, and costs the victims one sync's repair
of that bucket: the next sync, with another peer, compares again. Because
an accusation's fingerprint leaves out its accuser, a sync never passes on
a second accuser of a suspicion both sides hold; gossip carries those
(Lifeguard's confirmations), as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import reduce
from operator import xor
from typing import Final

from mesh.identity import NODE_ID_BYTES
from mesh.messages import Alive, Dead, Record, Suspect

MAX_BUCKET_BITS: Final = 8
"""Digests have at most 2**8 = 256 buckets, taken from the first byte of a
member id. Every table keeps one 63-bit XOR per bucket: 2 KiB a table, 20
MB for 10,000 simulated nodes; a finer split would cost 10,000 simulated
nodes hundreds of MB for little gain, since step three already narrows a
differing bucket down to the members that differ (by their fingerprints)."""

BUCKETS: Final = 1 << MAX_BUCKET_BITS

MAX_RECENT: Final = 16
"""Members whose state a digest carries: those the sender changed most
recently (since its last sync). In a calm swarm a refutation, the change a
sync most needs to pass on quickly, stays among these at nearly every
member for the whole of a lone suspicion's timeout; 16 members (~2.5 KB,
~20 KB if every one's record changed too) cover the few changes a healthy
swarm sees per sync period, and bound what a digest costs while a
partition changes them all."""

MEMBERS_PER_BUCKET: Final = 4
"""A digest has the fewest buckets (up to 256) that hold about this many
members each: a 2-node swarm sends one fingerprint, a 1,000-node swarm 256.
Fewer members per bucket make the state sent for a differing bucket
shorter; more buckets make every digest longer (9 bytes each on the wire)."""


def digest_bits(members: int) -> int:
    """Bucket bits for a digest of a table of `members` members."""
    bits = 0
    while bits < MAX_BUCKET_BITS and members >> bits > MEMBERS_PER_BUCKET:
        bits += 1
    return bits


def bits_for(buckets: int) -> int | None:
    """The bits a digest of `buckets` fingerprints was made at; None unless
    `buckets` is a power of two no larger than `BUCKETS`."""
    if buckets < 1 or buckets > BUCKETS or buckets & (buckets - 1):
        return None
    return buckets.bit_length() - 1


def fine_range(bucket: int, bits: int) -> range:
    """The fine (`MAX_BUCKET_BITS`) buckets that bucket `bucket` at `bits` covers."""
    width = 1 << (MAX_BUCKET_BITS - bits)
    return range(bucket * width, (bucket + 1) * width)


def fine_bucket(node: bytes) -> int:
    """Member `node`'s fine bucket: its id's first byte (`MAX_BUCKET_BITS` is 8)."""
    return node[0]


def bucket_of(node: bytes, bits: int) -> int:
    """The bucket of member `node` in a digest at `bits`."""
    return node[0] >> (MAX_BUCKET_BITS - bits)


def fold(fine: Sequence[int], bits: int) -> tuple[int, ...]:
    """Fine bucket fingerprints folded into 2**bits buckets."""
    width = 1 << (MAX_BUCKET_BITS - bits)
    if width == 1:
        return tuple(fine)
    return tuple(reduce(xor, fine[start : start + width]) for start in range(0, BUCKETS, width))


def member_fingerprint(
    alive: Alive, accusation: Suspect | Dead | None, record: Record | None
) -> int:
    """One member's state and record, hashed: what step three compares."""
    fingerprint = alive.fingerprint()
    if accusation is not None:
        fingerprint ^= accusation.fingerprint()
    if record is not None:
        fingerprint ^= record.fingerprint()
    return fingerprint


def well_formed_delta(
    reply: bool,
    bits: int,
    buckets: Sequence[int],
    states: Sequence[Alive | Suspect | Dead],
    records: Sequence[Record],
) -> bool:
    """Whether a `SyncDelta` has the shape its step gives it: a reply names
    no buckets (bits 0); an answer to a digest names at least one bucket,
    ascending below 2**bits with bits within `MAX_BUCKET_BITS`, and holds
    only members of the buckets it names."""
    if reply:
        return bits == 0 and not buckets
    if not 0 <= bits <= MAX_BUCKET_BITS:
        return False
    if not buckets or buckets[0] < 0 or buckets[-1] >= 1 << bits:
        return False
    if any(earlier >= later for earlier, later in itertools.pairwise(buckets)):
        return False
    named = set(buckets)
    return all(
        len(update.node) == NODE_ID_BYTES and bucket_of(update.node, bits) in named
        for part in (states, records)
        for update in part
    )
