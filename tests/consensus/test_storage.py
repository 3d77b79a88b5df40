"""Durable Raft storage: round trips, caller-bug refusals, and damaged files.

Every test uses a real sqlite file under tmp_path; damage is done to the
bytes on disk (or with a second sqlite connection, as a buggy tool would),
and every refusal must name the file.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from consensus.log import Entry, EntryKind, HardState, Snapshot
from consensus.storage import (
    SCHEMA_VERSION,
    CompactedError,
    LogOrderError,
    RaftStorage,
    StorageError,
    UnavailableError,
)

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def ents(lo: int, hi: int, term: int, size: int = 8) -> list[Entry]:
    """Entries lo..hi inclusive, with data that differs per index."""
    return [
        Entry(term, i, EntryKind.COMMAND, i.to_bytes(4, "big") * (size // 4))
        for i in range(lo, hi + 1)
    ]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "raft.sqlite"


def test_fresh_store_is_empty_and_configured(db: Path) -> None:
    with RaftStorage.open(db) as store:
        state = store.load()
        assert state.hard_state == HardState()
        assert state.snapshot is None
        assert state.entries == ()
        assert (store.first_index(), store.last_index(), store.term_at(0)) == (1, 0, 0)
        conn = store._conn
        assert conn is not None
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert not db.with_name(db.name + ".creating").exists()


def test_save_and_reopen_round_trip(db: Path) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 0), ents(1, 3, 1), None)
        store.save(HardState(2, B, 2), ents(4, 6, 2), None)
    with RaftStorage.open(db) as store:
        state = store.load()
        assert state.hard_state == HardState(2, B, 2)
        assert state.entries == tuple(ents(1, 3, 1) + ents(4, 6, 2))
        assert store.entries(2, 5) == tuple(ents(2, 3, 1) + ents(4, 4, 2))
        assert store.entries(3, 3) == ()
        assert [store.term_at(i) for i in range(7)] == [0, 1, 1, 1, 2, 2, 2]
        with pytest.raises(UnavailableError):
            store.term_at(7)
        with pytest.raises(UnavailableError):
            store.entries(1, 8)


def test_entries_overwrite_a_suffix(db: Path) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 0), ents(1, 5, 1), None)
        store.save(None, ents(4, 4, 2), None)  # a new leader's entry 4 replaces 4 and 5
        assert store.last_index() == 4
        assert store.entries(1, 5) == tuple(ents(1, 3, 1) + ents(4, 4, 2))
    with RaftStorage.open(db) as store:
        assert store.last_index() == 4


def test_snapshot_matching_the_log_keeps_the_entries_after_it(db: Path) -> None:
    snap = Snapshot(3, 1, frozenset({A, B}), frozenset({C}), b"ledger-state")
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 3), ents(1, 5, 1), None)
        store.save(None, [], snap)
        assert (store.first_index(), store.last_index(), store.term_at(3)) == (4, 5, 1)
        with pytest.raises(CompactedError):
            store.term_at(2)
        with pytest.raises(CompactedError):
            store.entries(3, 5)
    with RaftStorage.open(db) as store:
        state = store.load()
        assert state.snapshot == snap
        assert state.entries == tuple(ents(4, 5, 1))


def test_snapshot_that_conflicts_replaces_the_log(db: Path) -> None:
    snap = Snapshot(7, 3, frozenset({A}), frozenset(), b"s")
    with RaftStorage.open(db) as store:
        store.save(HardState(2, A, 2), ents(1, 4, 2), None)
        store.save(HardState(3, None, 7), ents(8, 9, 3), snap)
        assert store.load().entries == tuple(ents(8, 9, 3))
        assert (store.first_index(), store.last_index()) == (8, 9)
    with RaftStorage.open(db) as store:
        assert store.load().snapshot == snap


def test_compact_only_what_a_snapshot_covers(db: Path) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 4), ents(1, 5, 1), None)
        with pytest.raises(LogOrderError, match="only covers 0"):
            store.compact(2)
        store.save(None, [], Snapshot(4, 1, frozenset({A}), frozenset(), b""))
        store.compact(4)
        assert store.load().entries == tuple(ents(5, 5, 1))


@pytest.mark.parametrize(
    ("hard_state", "entries", "match"),
    [
        (None, [*ents(4, 4, 1), *ents(6, 6, 1)], "not consecutive"),
        (None, ents(7, 8, 1), "gap after 5"),
        (None, [*ents(6, 6, 2), *ents(7, 7, 1)], "backwards"),
        (None, ents(6, 6, 0), "below 1"),
        (None, ents(2, 2, 2), "replace a committed entry"),
        (HardState(0, None, 3), [], "term would go back"),
        (HardState(1, B, 3), [], "vote in term 1 would change"),
        (HardState(1, A, 2), [], "commit would go back"),
        (HardState(1, A, 6), [], "past the last index"),
        (None, ents(4, 4, 1), "past the last index 4"),  # same entry, but drops 5
        (None, ents(1, 1, 1), "inside the snapshot"),
    ],
)
def test_caller_bugs_are_refused_and_change_nothing(
    db: Path, hard_state: HardState | None, entries: list[Entry], match: str
) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 3), ents(1, 5, 1), None)
        if match == "inside the snapshot":
            store.save(None, [], Snapshot(1, 1, frozenset({A}), frozenset(), b""))
        if match == "past the last index 4":
            store.save(HardState(1, A, 5), [], None)
        before = store.load()
        with pytest.raises(LogOrderError, match=match):
            store.save(hard_state, entries, None)
        assert store.load() == before
    with RaftStorage.open(db) as store:
        assert store.load() == before


def test_resending_committed_entries_is_harmless(db: Path) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 3), ents(1, 5, 1), None)
        store.save(None, ents(2, 6, 1), None)
        assert store.last_index() == 6


def test_older_snapshot_is_refused(db: Path) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 5), ents(1, 5, 1), None)
        store.save(None, [], Snapshot(4, 1, frozenset({A}), frozenset(), b""))
        with pytest.raises(LogOrderError, match="older"):
            store.save(None, [], Snapshot(3, 1, frozenset({A}), frozenset(), b""))
        with pytest.raises(LogOrderError, match="both voter and learner"):
            store.save(None, [], Snapshot(5, 1, frozenset({A}), frozenset({A}), b""))


def test_closed_store_refuses_use(db: Path) -> None:
    store = RaftStorage.open(db)
    store.close()
    store.close()
    with pytest.raises(StorageError, match=str(db)):
        store.save(HardState(1, A, 0), [], None)


def test_interrupted_creation_leftover_is_ignored(db: Path) -> None:
    db.with_name(db.name + ".creating").write_bytes(b"half-made")
    with RaftStorage.open(db) as store:
        assert store.last_index() == 0


# -- damaged stores ------------------------------------------------------------


def _filled(db: Path, n: int = 300, size: int = 1000) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(3, A, n - 1), ents(1, n, 3, size), None)
    # closing the last connection checkpoints the WAL into the main file
    assert not Path(f"{db}-wal").exists()


def _refused(db: Path, match: str = "") -> StorageError:
    with pytest.raises(StorageError) as info:
        RaftStorage.open(db)
    message = str(info.value)
    assert str(db) in message
    assert match in message
    return info.value


def test_garbage_file(db: Path) -> None:
    db.write_bytes(b"this is not a database, it is a shopping list\n" * 200)
    _refused(db, "not a database")


def test_empty_file_is_not_first_use(db: Path) -> None:
    db.write_bytes(b"")
    _refused(db, "no schema")


@pytest.mark.parametrize("keep", [0.5, 0.1])
def test_truncated_file(db: Path, keep: float) -> None:
    _filled(db)
    data = db.read_bytes()
    db.write_bytes(data[: int(len(data) * keep)])
    _refused(db)


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_over_a_page(db: Path, seed: int) -> None:
    _filled(db)
    rng = random.Random(seed)
    data = bytearray(db.read_bytes())
    page = 4096
    pages = len(data) // page
    victim = rng.randrange(1, pages)  # never page 0: that is the header/schema page
    data[victim * page : (victim + 1) * page] = rng.randbytes(page)
    db.write_bytes(bytes(data))
    _refused(db)


def test_flipped_bit_inside_entry_data(db: Path) -> None:
    _filled(db)
    data = bytearray(db.read_bytes())
    at = data.index((150).to_bytes(4, "big") * 250)  # entry 150's payload
    data[at + 100] ^= 0x01
    db.write_bytes(bytes(data))
    _refused(db, "checksum mismatch in log entry 150")


def _tamper(db: Path, *sql: str) -> None:
    conn = sqlite3.connect(db)
    with conn:
        for statement in sql:
            conn.execute(statement)
    conn.close()


def test_deleted_row_is_a_gap(db: Path) -> None:
    _filled(db, n=20, size=8)
    _tamper(db, "DELETE FROM log WHERE idx = 7")
    _refused(db, "gap in the log: expected index 7")


def test_log_not_starting_after_snapshot_is_a_gap(db: Path) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 5), ents(1, 8, 1), None)
        store.save(None, [], Snapshot(3, 1, frozenset({A}), frozenset(), b""))
    _tamper(db, "DELETE FROM log WHERE idx = 4")
    _refused(db, "expected index 4 after the snapshot")


def test_commit_past_the_last_index(db: Path) -> None:
    _filled(db, n=20, size=8)
    _tamper(db, "DELETE FROM log WHERE idx >= 15")
    _refused(db, "commit index 19 is past the last stored index 14")


def test_wrong_schema_version(db: Path) -> None:
    RaftStorage.open(db).close()
    _tamper(db, f"UPDATE meta SET value = {SCHEMA_VERSION + 1} WHERE key = 'schema_version'")
    _refused(db, f"schema version is {SCHEMA_VERSION + 1}")


def test_edited_hard_state(db: Path) -> None:
    RaftStorage.open(db).close()
    _tamper(db, "UPDATE hard_state SET term = 9")
    _refused(db, "checksum mismatch in the hard state")


def test_missing_snapshot_member(db: Path) -> None:
    with RaftStorage.open(db) as store:
        store.save(HardState(1, A, 2), ents(1, 2, 1), None)
        store.save(None, [], Snapshot(2, 1, frozenset({A, B}), frozenset(), b""))
    _tamper(db, "DELETE FROM snapshot_member WHERE node = x'" + B.hex() + "'")
    _refused(db, "checksum mismatch in the snapshot")


def test_foreign_sqlite_database(db: Path) -> None:
    _tamper(db, "CREATE TABLE photos (id INTEGER)")
    _refused(db, "no schema")


def test_bulk_save_is_fast(db: Path) -> None:
    with RaftStorage.open(db) as store:
        for batch in range(20):
            lo = batch * 500 + 1
            store.save(HardState(1, A, lo - 1), ents(lo, lo + 499, 1, 64), None)
        assert store.last_index() == 10_000
    with RaftStorage.open(db) as store:
        assert len(store.load().entries) == 10_000
