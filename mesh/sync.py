"""Delta sync: two members find what they hold differently without trading it all.

A full push-pull sends and merges the whole member table every sync, though
two healthy members almost always agree on every entry. Here the initiator
sends a digest (its table folded into 2**k buckets, each the XOR of its
members' 63-bit fingerprints, plus its most recent changes: `SyncDigest`);
the other side answers only for the buckets that differ (`SyncDelta`), and
the initiator replies with its side of those buckets. What is merged is
what a full push-pull would have changed, through the same checks. Joins
and strangers still get a full `PushPull`.

Why three messages, what the recent changes are for, and what a Byzantine
member can do to a digest: docs/design/membership.md#delta-sync.
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
