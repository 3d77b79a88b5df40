"""Chunks, their reassembly and per-peer byte budgets (mesh/chunks.py), sans-IO."""

from __future__ import annotations

import collections
import os

import pytest

from mesh.chunks import (
    MAGIC,
    MAX_FRAMES,
    PIECE_BYTES,
    SINGLE_MESSAGE_BYTES,
    ByteBudgets,
    Intake,
    Reassembly,
    decode,
    is_chunk,
    split,
)

ALICE = b"a" * 32
BOB = b"b" * 32
PIECE = 1000


def table(grants: dict[bytes, int], **kwargs: float) -> tuple[Reassembly, collections.Counter[str]]:
    drops: collections.Counter[str] = collections.Counter()
    reassembly = Reassembly(
        lambda peer: grants.get(peer, 0),
        lambda reason: drops.update([reason]),
        max_message=1_000_000,
        **kwargs,  # type: ignore[arg-type]
    )
    return reassembly, drops


def feed(reassembly: Reassembly, peer: bytes, chunks: list[list[bytes | memoryview]]) -> object:
    results = [reassembly.add(peer, chunk, 0.0) for chunk in chunks]
    assert all(result is None for result in results[:-1])
    return results[-1]


def test_split_makes_views_that_never_span_frames() -> None:
    header, raw = b"h" * 10, os.urandom(2500)
    chunks = split(7, [header, raw], PIECE)
    assert [len(memoryview(c[1])) for c in chunks] == [10, 1000, 1000, 500]
    assert all(is_chunk(c[0]) for c in chunks)
    first = decode(chunks[0])
    assert (first.message_id, first.index, first.sizes) == (7, 0, (10, 2500))
    assert decode(chunks[3]).index == 3 and decode(chunks[3]).sizes is None
    assert not is_chunk(b"\xa4rest of a CBOR map")
    with pytest.raises(ValueError):
        split(1, [b""] * (MAX_FRAMES + 1))


def test_a_granted_peer_gets_its_message_back_whole() -> None:
    reassembly, drops = table({ALICE: 10_000})
    frames = [b"header", os.urandom(4321), b"", b"tail"]
    assert feed(reassembly, ALICE, split(1, frames, PIECE)) == frames
    assert not drops and reassembly.pending_bytes == 0 and reassembly.in_progress == 0


def test_a_peer_without_a_grant_is_refused_at_every_chunk() -> None:
    reassembly, drops = table({ALICE: 100})
    chunks = split(1, [os.urandom(3000)], PIECE)
    assert feed(reassembly, BOB, chunks) is None  # no grant
    assert feed(reassembly, ALICE, chunks) is None  # a grant too small
    assert drops == {"bulk_refused": 6}
    assert reassembly.pending_bytes == 0


def test_a_message_over_the_plane_cap_is_refused_whatever_the_grant() -> None:
    reassembly, drops = table({ALICE: 10**9})
    assert reassembly.add(ALICE, split(1, [b"x" * 1_000_001], 10**6)[0], 0.0) is None
    assert drops == {"bulk_refused": 1}


def test_pending_bytes_are_bounded_across_peers() -> None:
    reassembly, drops = table({ALICE: 10_000, BOB: 10_000}, max_pending=5000)
    alice = split(1, [bytes(3000)], PIECE)
    bob = split(2, [bytes(3000)], PIECE)
    assert reassembly.add(ALICE, alice[0], 0.0) is None
    assert reassembly.pending_bytes == 3000
    assert feed(reassembly, BOB, bob) is None  # no room for Bob's 3000
    assert drops == {"bulk_busy": 1, "bulk_refused": 2}
    assert feed(reassembly, ALICE, alice[1:]) == [bytes(3000)]
    assert reassembly.pending_bytes == 0
    assert feed(reassembly, BOB, split(3, [bytes(3000)], PIECE)) == [bytes(3000)]


def test_a_lost_chunk_or_a_new_message_ends_the_partial_one() -> None:
    reassembly, drops = table({ALICE: 10_000})
    first = split(1, [bytes(3000)], PIECE)
    second = split(2, [b"y" * 2000], PIECE)
    reassembly.add(ALICE, first[0], 0.0)
    assert reassembly.add(ALICE, first[2], 0.0) is None  # first[1] was lost
    assert drops == {"bulk_incomplete": 1} and reassembly.pending_bytes == 0
    reassembly.add(ALICE, first[0], 0.0)
    assert feed(reassembly, ALICE, second) == [b"y" * 2000]  # replaces the partial one
    assert drops == {"bulk_incomplete": 2}


def test_a_stale_partial_message_is_discarded() -> None:
    reassembly, drops = table({ALICE: 10_000}, stale_after_s=5.0)
    chunks = split(1, [bytes(3000)], PIECE)
    reassembly.add(ALICE, chunks[0], 0.0)
    reassembly.expire(4.0)
    assert reassembly.in_progress == 1
    reassembly.expire(5.0)
    assert reassembly.in_progress == 0 and reassembly.pending_bytes == 0
    assert drops == {"bulk_incomplete": 1}
    assert reassembly.add(ALICE, chunks[1], 6.0) is None
    assert drops["bulk_refused"] == 1


@pytest.mark.parametrize(
    "frames",
    [
        [MAGIC],  # one frame
        [MAGIC + b"short", b"x"],
        [split(1, [bytes(2000)], PIECE)[0][0] + b"extra", b"x"],
        [split(1, [bytes(2000)], PIECE)[1][0] + b"extra", b"x"],
    ],
)
def test_malformed_chunks_are_dropped(frames: list[bytes]) -> None:
    reassembly, drops = table({ALICE: 10_000})
    assert reassembly.add(ALICE, frames, 0.0) is None
    assert drops == {"bulk_malformed": 1}


def test_pieces_that_do_not_fit_the_declared_frames_are_malformed() -> None:
    reassembly, drops = table({ALICE: 10_000})
    head = split(1, [bytes(1500)], PIECE)[0][0]
    reassembly.add(ALICE, [head, bytes(1000)], 0.0)
    assert reassembly.add(ALICE, [split(1, [bytes(1500)], PIECE)[1][0], bytes(900)], 0.0) is None
    assert drops == {"bulk_malformed": 1} and reassembly.pending_bytes == 0


def test_byte_budgets_refill_at_their_rate_up_to_the_burst() -> None:
    budgets = ByteBudgets(rate=100, burst=1000, max_peers=2)
    assert budgets.take(ALICE, 1000, 0.0)
    assert not budgets.take(ALICE, 1, 0.0)
    assert budgets.take(BOB, 1000, 0.0)  # each peer its own bucket
    assert not budgets.take(ALICE, 200, 1.0)
    assert budgets.take(ALICE, 200, 2.0)
    assert budgets.take(ALICE, 1000, 100.0)  # never more than the burst
    assert not budgets.take(ALICE, 1, 100.0)
    assert budgets.take(b"c" * 32, 1000, 100.0)  # a third peer evicts the oldest
    with pytest.raises(ValueError):
        ByteBudgets(rate=0)


def test_the_intake_charges_every_message_and_lets_only_allowed_peers_past_their_budget() -> None:
    drops: collections.Counter[str] = collections.Counter()
    intake = Intake(
        lambda reason: drops.update([reason]),
        max_message=10**7,
        budgets=ByteBudgets(rate=1, burst=3 * PIECE_BYTES),
    )
    intake.allowance = lambda peer: 10**7 if peer == ALICE else 0
    big = [b"h", os.urandom(2 * PIECE_BYTES + 5)]
    assert intake.take(BOB, [b"small", b"frames"], 0.0) == [b"small", b"frames"]
    assert intake.take(BOB, [bytes(SINGLE_MESSAGE_BYTES + 1)], 0.0) is None
    assert [intake.take(BOB, chunk, 0.0) for chunk in split(1, big)] == [None] * 4
    # Refused at every chunk, and the one that did not fit the budget as such.
    assert drops == {"oversized": 1, "bulk_refused": 3, "over_budget": 1}
    results = [intake.take(ALICE, chunk, 0.0) for chunk in split(2, big)]
    assert results[:-1] == [None] * 3 and results[-1] == big
    assert intake.take(ALICE, [bytes(PIECE_BYTES)], 0.0) == [bytes(PIECE_BYTES)]  # over, allowed
    assert drops == {"oversized": 1, "bulk_refused": 3, "over_budget": 1}
