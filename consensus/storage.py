"""Durable Raft state in sqlite: hard state, log and latest snapshot.

Raft is only safe if a node never forgets what it promised: its term, its
vote in that term and every entry it acknowledged. The driver therefore calls
`RaftStorage.save` with a Ready's hard state, entries and snapshot *before*
sending that Ready's messages, and `save` returns only once one sqlite
transaction holding all three is committed with `synchronous=FULL` (fsync of
the WAL on every commit).

Three rules shape this module:

* **Never a silent reset.** A store that is not a sqlite file, fails sqlite's
  own check, has the wrong schema version, a gap in its log, a checksum that
  does not match or a commit index past its last entry raises `StorageError`
  naming the file. Starting empty instead would let a voter vote twice in a
  term or forget acknowledged entries; an operator must decide what to do.
* **Caller bugs are loud.** `save` checks that entries are contiguous, follow
  the log without a gap, never rewrite a committed entry, and that the hard
  state never goes backwards or changes its vote within a term. A violation
  raises `LogOrderError` and rolls back: persisting it would turn a bug in
  the core into corruption on disk.
* **Atomic creation.** A new store is built in a temporary file and renamed
  into place, so a file at `path` always holds a complete schema: an empty or
  schema-less file there is damage, not "first use".

Every row carries a CRC-32 of its values, because sqlite's checks cover the
b-tree structure but not the bytes inside a record: a flipped bit in an
entry's data would otherwise be applied to the state machine unnoticed.

The object is not thread-safe; the driver serializes calls (it may make them
from a worker thread, hence `check_same_thread=False`).
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, NoReturn, Self

from consensus.log import Entry, EntryKind, HardState, Snapshot
from mesh.files import replace_durably

SCHEMA_VERSION: Final = 1
"""Bump on any change to the tables below; an unknown version is refused, not migrated blindly."""

CHECK_PRAGMA: Final = "quick_check"
"""sqlite's structural check on open. `quick_check` finds the same page-level
damage as `integrity_check` for our tables (they have no secondary indexes,
which is all `integrity_check` adds) at a fraction of the cost; row contents
are covered by our own CRCs."""

BUSY_TIMEOUT_S: Final = 1.0
"""One process owns a state dir (runtime.node.state_dir locks it), so contention
means something is wrong: fail fast instead of sqlite's default 5 s wait."""

_SCHEMA: Final = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE hard_state (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    term INTEGER NOT NULL, vote BLOB, commit_index INTEGER NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE log (
    idx INTEGER PRIMARY KEY,
    term INTEGER NOT NULL, kind INTEGER NOT NULL, data BLOB NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE snapshot (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    idx INTEGER NOT NULL, term INTEGER NOT NULL, data BLOB NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE snapshot_member (
    node BLOB PRIMARY KEY, learner INTEGER NOT NULL CHECK (learner IN (0, 1)));
"""

_U64: Final = struct.Struct(">Q")


class StorageError(Exception):
    """The store on disk is unusable (corrupt, truncated, foreign); the message names the file."""


class LogOrderError(ValueError):
    """A `save`/`compact` call that would break a Raft invariant: a bug in the caller."""


class CompactedError(LookupError):
    """The requested index is covered by the snapshot; its entry is gone."""


class UnavailableError(LookupError):
    """The requested index is past the last entry."""


@dataclass(frozen=True, slots=True)
class LoadedState:
    """Everything a restarting node needs: hard state, snapshot, and the log after it."""

    hard_state: HardState
    snapshot: Snapshot | None
    entries: tuple[Entry, ...]


def _crc(*parts: int | bytes | None) -> int:
    # Each part is length-prefixed (or a fixed 8 bytes, or a None marker) so
    # that distinct rows can never serialize to the same byte string.
    crc = 0
    for part in parts:
        if part is None:
            chunk = b"\x00"
        elif isinstance(part, int):
            chunk = b"\x01" + _U64.pack(part)
        else:
            chunk = b"\x02" + _U64.pack(len(part)) + part
        crc = zlib.crc32(chunk, crc)
    return crc


def _entry_crc(index: int, term: int, kind: int, data: bytes) -> int:
    return _crc(index, term, kind, data)


def _hard_state_crc(term: int, vote: bytes | None, commit: int) -> int:
    return _crc(term, vote, commit)


def _snapshot_crc(index: int, term: int, data: bytes, members: Iterable[tuple[bytes, int]]) -> int:
    parts: list[int | bytes | None] = [index, term, data]
    for node, learner in sorted(members):
        parts += [node, learner]
    return _crc(*parts)


class RaftStorage:
    """One node's durable Raft state. Open with `RaftStorage.open(path)`."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        """Use `open`; this only wires an already-verified connection."""
        self.path = path
        self._conn: sqlite3.Connection | None = conn
        self._hard_state = HardState()
        self._snap_index = 0
        self._snap_term = 0
        self._last_index = 0

    # -- opening -------------------------------------------------------------

    @classmethod
    def open(cls, path: Path) -> RaftStorage:
        """Open (or atomically create) the store at `path`, verifying it fully.

        Raises `StorageError` naming `path` for anything that is not a
        complete, consistent store of this schema version.
        """
        path = Path(path)
        if not path.exists():
            _create(path)
        try:
            conn = sqlite3.connect(
                path, isolation_level=None, timeout=BUSY_TIMEOUT_S, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise StorageError(_corrupt(path, f"cannot open it: {exc}")) from exc
        store = cls(path, conn)
        try:
            store._verify()
        except sqlite3.Error as exc:
            conn.close()
            raise StorageError(_corrupt(path, f"sqlite says: {exc}")) from exc
        except BaseException:
            conn.close()
            raise
        return store

    def _verify(self) -> None:
        conn = self._live()
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            self._fail(f"cannot switch to WAL journal mode (got {mode!r})")
        conn.execute("PRAGMA synchronous=FULL")
        problems = [row[0] for row in conn.execute(f"PRAGMA {CHECK_PRAGMA}")]
        if problems != ["ok"]:
            self._fail(f"{CHECK_PRAGMA} failed: {'; '.join(map(str, problems[:5]))}")
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        if "meta" not in tables:
            self._fail("it has no schema (empty or not a shardmesh Raft store)")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None or row[0] != SCHEMA_VERSION:
            found = "none" if row is None else repr(row[0])
            self._fail(f"schema version is {found}, this build reads {SCHEMA_VERSION}")
        missing = {"hard_state", "log", "snapshot", "snapshot_member"} - tables
        if missing:
            self._fail(f"tables missing: {', '.join(sorted(missing))}")

        self._hard_state = self._read_hard_state()
        snapshot = self._read_snapshot()
        if snapshot is not None:
            self._snap_index, self._snap_term = snapshot.index, snapshot.term
        # A full scan: every row's checksum, kind, contiguity and term order.
        expected, prev_term = self._snap_index + 1, self._snap_term
        for entry in self._iter_entries("SELECT idx, term, kind, data, crc FROM log ORDER BY idx"):
            if entry.index != expected:
                what = "the snapshot" if expected == self._snap_index + 1 else "the log"
                self._fail(
                    f"gap in the log: expected index {expected} after {what}, found {entry.index}"
                )
            if entry.term < prev_term:
                self._fail(f"log term goes backwards at index {entry.index}")
            expected, prev_term = expected + 1, entry.term
        self._last_index = expected - 1
        if self._hard_state.commit > self._last_index:
            self._fail(
                f"hard state commit index {self._hard_state.commit} is past the last "
                f"stored index {self._last_index} (truncated log?)"
            )

    # -- reading -------------------------------------------------------------

    def load(self) -> LoadedState:
        """Hard state, snapshot and every entry after it, for a restarting core."""
        return LoadedState(
            hard_state=self._hard_state,
            snapshot=self.snapshot(),
            entries=self.entries(self.first_index(), self._last_index + 1),
        )

    @property
    def hard_state(self) -> HardState:
        """The last saved hard state (cached; it is tiny and read on every Ready)."""
        return self._hard_state

    def snapshot(self) -> Snapshot | None:
        """The latest saved snapshot, or None before the first one."""
        return self._read_snapshot()

    def first_index(self) -> int:
        """The first index that still has an entry (or would have): snapshot index + 1."""
        return self._snap_index + 1

    def last_index(self) -> int:
        """The last index in the log, or the snapshot's index when the log after it is empty."""
        return self._last_index

    def term_at(self, index: int) -> int:
        """Term of the entry at `index`; the snapshot's term at its own index (0 at index 0)."""
        if index == self._snap_index:
            return self._snap_term
        if index < self._snap_index:
            raise CompactedError(f"index {index} is compacted (snapshot at {self._snap_index})")
        if index > self._last_index:
            raise UnavailableError(f"index {index} is past the last index {self._last_index}")
        row = self._live().execute("SELECT term FROM log WHERE idx = ?", (index,)).fetchone()
        if row is None:  # contiguity was verified on open and kept by save
            self._fail(f"log row {index} vanished while open")
        return int(row[0])

    def entries(self, lo: int, hi: int) -> tuple[Entry, ...]:
        """Entries with `lo <= index < hi` (etcd's half-open range)."""
        if lo < self.first_index():
            raise CompactedError(f"index {lo} is compacted (snapshot at {self._snap_index})")
        if hi > self._last_index + 1:
            raise UnavailableError(f"index {hi - 1} is past the last index {self._last_index}")
        if lo >= hi:
            return ()
        return tuple(
            self._iter_entries(
                "SELECT idx, term, kind, data, crc FROM log WHERE idx >= ? AND idx < ? "
                "ORDER BY idx",
                (lo, hi),
            )
        )

    # -- writing -------------------------------------------------------------

    def save(
        self,
        hard_state: HardState | None,
        entries: Sequence[Entry],
        snapshot: Snapshot | None,
    ) -> None:
        """Persist one Ready atomically; durable (fsync'd) when this returns.

        Order inside the transaction: the snapshot (dropping the entries it
        covers), then the entries (truncating any suffix they overwrite), then
        the hard state. Raises `LogOrderError`, leaving the store unchanged,
        when the call would break a Raft invariant.
        """
        conn = self._live()
        snap_index, snap_term, last = self._snap_index, self._snap_term, self._last_index
        hs = self._hard_state
        with self._transaction():
            if snapshot is not None:
                self._check_snapshot(snapshot)
                # Raft paper, section 7: a snapshot that matches the log at its
                # index keeps the entries after it; otherwise the log is replaced.
                keep = snapshot.index < last and self._db_term(snapshot.index) == snapshot.term
                if keep:
                    conn.execute("DELETE FROM log WHERE idx <= ?", (snapshot.index,))
                else:
                    conn.execute("DELETE FROM log")
                    last = snapshot.index
                self._write_snapshot(snapshot)
                snap_index, snap_term = snapshot.index, snapshot.term
                last = max(last, snap_index)
            if entries:
                self._check_entries(entries, snap_index, snap_term, last, hs.commit)
                conn.execute("DELETE FROM log WHERE idx >= ?", (entries[0].index,))
                conn.executemany(
                    "INSERT INTO log (idx, term, kind, data, crc) VALUES (?, ?, ?, ?, ?)",
                    [
                        (e.index, e.term, int(e.kind), bytes(e.data),
                         _entry_crc(e.index, e.term, int(e.kind), bytes(e.data)))
                        for e in entries
                    ],
                )  # fmt: skip
                last = entries[-1].index
            if hard_state is not None:
                self._check_hard_state(hard_state, hs)
                self._write_hard_state(hard_state)
                hs = hard_state
            if hs.commit > last:
                raise LogOrderError(
                    f"commit index {hs.commit} would be past the last index {last}: "
                    "committed entries must never be truncated"
                )
        self._snap_index, self._snap_term, self._last_index = snap_index, snap_term, last
        self._hard_state = hs

    def compact(self, index: int) -> None:
        """Drop entries `<= index`; allowed only where the saved snapshot covers them.

        `save` already drops what a new snapshot covers, so this is a guard
        for callers that compact explicitly: it never loses an entry that no
        snapshot replaces.
        """
        if index > self._snap_index:
            raise LogOrderError(
                f"cannot compact through {index}: the snapshot only covers {self._snap_index}"
            )
        with self._transaction():
            self._live().execute("DELETE FROM log WHERE idx <= ?", (index,))

    # -- closing -------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (sqlite checkpoints the WAL into the file). Idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- checks ----------------------------------------------------------------

    def _check_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.index < self._snap_index:
            raise LogOrderError(
                f"snapshot at {snapshot.index} is older than the saved one at {self._snap_index}"
            )
        if snapshot.index == self._snap_index and snapshot.term != self._snap_term:
            raise LogOrderError(
                f"snapshot at {snapshot.index} has term {snapshot.term}, "
                f"the saved one has {self._snap_term}"
            )
        if snapshot.voters & snapshot.learners:
            raise LogOrderError("snapshot lists a node as both voter and learner")

    def _check_entries(
        self, entries: Sequence[Entry], snap_index: int, snap_term: int, last: int, commit: int
    ) -> None:
        first = entries[0].index
        for prev, cur in itertools.pairwise(entries):
            if cur.index != prev.index + 1:
                raise LogOrderError(f"entries not consecutive: {prev.index} then {cur.index}")
            if cur.term < prev.term:
                raise LogOrderError(f"entry terms go backwards at index {cur.index}")
        if first <= snap_index:
            raise LogOrderError(
                f"entries start at {first}, inside the snapshot (through {snap_index})"
            )
        if first > last + 1:
            raise LogOrderError(f"entries start at {first}, leaving a gap after {last}")
        prev_term = snap_term if first - 1 == snap_index else self._db_term(first - 1)
        if prev_term is not None and entries[0].term < prev_term:
            raise LogOrderError(
                f"entry {first} has term {entries[0].term}, below {prev_term} before it"
            )
        # Re-sending a committed entry is harmless (same index and term means
        # the same entry); replacing one with a different term never is.
        upto = min(commit, last, entries[-1].index)
        if first <= upto:
            stored = self._live().execute(
                "SELECT idx, term FROM log WHERE idx >= ? AND idx <= ?", (first, upto)
            )
            for index, term in stored:
                if entries[index - first].term != term:
                    raise LogOrderError(
                        f"entry {index} would replace a committed entry (commit {commit})"
                    )

    def _check_hard_state(self, new: HardState, old: HardState) -> None:
        if new.term < old.term:
            raise LogOrderError(f"term would go back from {old.term} to {new.term}")
        if new.term == old.term and old.vote is not None and new.vote != old.vote:
            raise LogOrderError(f"vote in term {new.term} would change: a node votes once per term")
        if new.commit < old.commit:
            raise LogOrderError(f"commit would go back from {old.commit} to {new.commit}")

    # -- sqlite plumbing -------------------------------------------------------

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StorageError(f"{self.path}: Raft store is closed")
        return self._conn

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        conn = self._live()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _db_term(self, index: int) -> int | None:
        row = self._live().execute("SELECT term FROM log WHERE idx = ?", (index,)).fetchone()
        return None if row is None else int(row[0])

    def _iter_entries(self, sql: str, params: tuple[int, ...] = ()) -> Iterator[Entry]:
        for index, term, kind, data, crc in self._live().execute(sql, params):
            if not isinstance(data, bytes) or _entry_crc(index, term, kind, data) != crc:
                self._fail(f"checksum mismatch in log entry {index}")
            try:
                entry_kind = EntryKind(kind)
            except ValueError:
                self._fail(f"log entry {index} has unknown kind {kind!r}")
            yield Entry(term=term, index=index, kind=entry_kind, data=data)

    def _read_hard_state(self) -> HardState:
        rows = (
            self._live().execute("SELECT term, vote, commit_index, crc FROM hard_state").fetchall()
        )
        if len(rows) != 1:
            self._fail("hard state row is missing")
        term, vote, commit, crc = rows[0]
        if _hard_state_crc(term, vote, commit) != crc:
            self._fail("checksum mismatch in the hard state")
        return HardState(term=term, vote=vote, commit=commit)

    def _write_hard_state(self, hs: HardState) -> None:
        vote = None if hs.vote is None else bytes(hs.vote)
        self._live().execute(
            "INSERT OR REPLACE INTO hard_state (id, term, vote, commit_index, crc) "
            "VALUES (0, ?, ?, ?, ?)",
            (hs.term, vote, hs.commit, _hard_state_crc(hs.term, vote, hs.commit)),
        )

    def _read_snapshot(self) -> Snapshot | None:
        conn = self._live()
        row = conn.execute("SELECT idx, term, data, crc FROM snapshot").fetchone()
        members = [
            (bytes(n), int(lr))
            for n, lr in conn.execute("SELECT node, learner FROM snapshot_member")
        ]
        if row is None:
            if members:
                self._fail("snapshot members are stored without a snapshot")
            return None
        index, term, data, crc = row
        if not isinstance(data, bytes) or _snapshot_crc(index, term, data, members) != crc:
            self._fail("checksum mismatch in the snapshot")
        return Snapshot(
            index=index,
            term=term,
            voters=frozenset(n for n, lr in members if not lr),
            learners=frozenset(n for n, lr in members if lr),
            data=data,
        )

    def _write_snapshot(self, snapshot: Snapshot) -> None:
        conn = self._live()
        members = [(bytes(n), 0) for n in snapshot.voters]
        members += [(bytes(n), 1) for n in snapshot.learners]
        data = bytes(snapshot.data)
        conn.execute("DELETE FROM snapshot_member")
        conn.executemany("INSERT INTO snapshot_member (node, learner) VALUES (?, ?)", members)
        conn.execute(
            "INSERT OR REPLACE INTO snapshot (id, idx, term, data, crc) VALUES (0, ?, ?, ?, ?)",
            (snapshot.index, snapshot.term, data,
             _snapshot_crc(snapshot.index, snapshot.term, data, members)),
        )  # fmt: skip

    def _fail(self, what: str) -> NoReturn:
        raise StorageError(_corrupt(self.path, what))


def _corrupt(path: Path, what: str) -> str:
    return (
        f"Raft store {path} is unusable: {what}. Refusing to start rather than reset it: "
        "a voter that forgets its vote or log can break Raft's safety. Restore the file "
        "from a backup, or remove it only if this node should rejoin as a new member."
    )


def _create(path: Path) -> None:
    """Build the schema in a temporary file, fsync it, and rename it into place."""
    tmp = path.with_name(path.name + ".creating")
    for stale in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm"), Path(f"{tmp}-journal")):
        stale.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(tmp, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (SCHEMA_VERSION,)
        )
        conn.execute(
            "INSERT INTO hard_state (id, term, vote, commit_index, crc) VALUES (0, 0, NULL, 0, ?)",
            (_hard_state_crc(0, None, 0),),
        )
        conn.execute("COMMIT")
        # WAL mode is recorded in the file header, so every later open finds it.
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()  # the last connection checkpoints and removes the -wal file
    replace_durably(tmp, path)
