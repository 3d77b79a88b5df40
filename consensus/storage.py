"""Durable Raft state in sqlite: hard state, log and latest snapshot.

Raft is only safe if a node never forgets its term, its vote or an entry it
acknowledged, so `RaftStorage.save` commits a Ready's hard state, entries and
snapshot in one fsync'd transaction before the driver sends its messages.
A damaged or unknown store raises `StorageError` naming the file (never a
silent reset), a caller bug raises `LogOrderError` and rolls back, and every
row carries a CRC-32. A marker beside the database notices a WAL that
silently lost its tail, so the node repairs before it votes again. The
rules and the marker's crash analysis are in docs/design/storage.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sqlite3
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, NoReturn, Self

from consensus.log import Entry, EntryKind, HardState, LogPosition, Snapshot
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

MARKER_SUFFIX: Final = ".marker"
"""The marker lives at `<database file><MARKER_SUFFIX>` (module doc)."""

MARKER_FORMAT: Final = 1
"""Bump on any change to the marker's fields or layout; an unknown format is refused."""

MARKER_SLOT: Final = 4096
"""The marker file is two slots of this size (`_MarkerFile`): one disk block
each, so a write torn by power loss cannot spoil both."""

log = logging.getLogger("shardmesh.raft.storage")


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
    damaged_until: LogPosition | None = None
    """Set when the log lost entries it had acknowledged (module doc): the
    node must not vote or campaign until a leader has replicated it to at
    least this position (`RaftNode(repair_until=...)`). None: intact."""


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


@dataclass(frozen=True, slots=True)
class _Marker:
    """What the store promised after its last batch (module doc)."""

    last: LogPosition
    """The log's last entry (the snapshot's position when the log after it is empty)."""
    repair: LogPosition | None
    """A repair still owed from an earlier damaged start, or None."""
    term: int
    vote: bytes | None

    def encode(self, seq: int) -> bytes:
        """One slot: a JSON record with its CRC, padded with NULs; `seq` orders the slots."""
        fields = {
            "format": MARKER_FORMAT,
            "seq": seq,
            "last_index": self.last.index,
            "last_term": self.last.term,
            "repair_index": None if self.repair is None else self.repair.index,
            "repair_term": None if self.repair is None else self.repair.term,
            "term": self.term,
            "vote": None if self.vote is None else self.vote.hex(),
        }
        body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        record = json.dumps({**fields, "crc": zlib.crc32(body.encode())}).encode() + b"\n"
        if len(record) > MARKER_SLOT:
            raise ValueError(f"marker record of {len(record)} bytes exceeds its slot")
        return record.ljust(MARKER_SLOT, b"\0")

    @classmethod
    def decode(cls, data: bytes) -> tuple[int, _Marker]:
        """Inverse of `encode`: (seq, marker); ValueError (with the reason) on anything else."""
        data = data.rstrip(b"\0")
        if not data:
            raise ValueError("empty")
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from exc
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        crc = fields.pop("crc", None)
        body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        if crc != zlib.crc32(body.encode()):
            raise ValueError("checksum mismatch")
        if fields.get("format") != MARKER_FORMAT:
            raise ValueError(
                f"format is {fields.get('format')!r}, this build reads {MARKER_FORMAT}"
            )
        repair = None
        if fields.get("repair_index") is not None or fields.get("repair_term") is not None:
            repair = LogPosition(
                term=_count(fields, "repair_term"), index=_count(fields, "repair_index")
            )
        vote = fields.get("vote")
        if vote is not None and not isinstance(vote, str):
            raise ValueError("the vote is not a hex string")
        return _count(fields, "seq"), cls(
            last=LogPosition(term=_count(fields, "last_term"), index=_count(fields, "last_index")),
            repair=repair,
            term=_count(fields, "term"),
            vote=None if vote is None else bytes.fromhex(vote),
        )


def _count(fields: dict[str, object], key: str) -> int:
    value = fields.get(key)
    if type(value) is not int or value < 0:
        raise ValueError(f"{key} is {value!r}, not a non-negative integer")
    return value


class RaftStorage:
    """One node's durable Raft state. Open with `RaftStorage.open(path)`."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        """Use `open`; this only wires an already-verified connection."""
        self.path = path
        self.marker_path = marker_path(path)
        self._marker_file = _MarkerFile(path)
        self._conn: sqlite3.Connection | None = conn
        self._hard_state = HardState()
        self._snap_index = 0
        self._snap_term = 0
        self._last_index = 0
        self._marker: _Marker | None = None
        """The marker as last read or written: a save that would not change it skips the write."""
        self._repair: LogPosition | None = None
        """A repair still owed (module doc); cleared once a saved log reaches it."""
        self.damaged_until: LogPosition | None = None
        """What `open` found: the log lost acknowledged entries up to here (None: intact)."""

    # -- opening -------------------------------------------------------------

    @classmethod
    def open(cls, path: Path) -> RaftStorage:
        """Open (or atomically create) the store at `path`, verifying it fully.

        Raises `StorageError` naming `path` for anything that is not a
        complete, consistent store of this schema version (or naming its
        marker, if that cannot be read). A log behind its marker opens, says
        so in a warning and sets `damaged_until` (module doc).
        """
        path = Path(path)
        if not path.exists():
            wal = Path(f"{path}-wal")
            if wal.exists():
                # A fresh file would pick up the orphaned WAL's frames (sqlite
                # does not check which database they belong to): a mix of two stores.
                raise StorageError(
                    _corrupt(path, f"the file is missing but its write-ahead log {wal} is there")
                )
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
            store._check_marker()
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

    def _check_marker(self) -> None:
        """Compare the verified store with its marker (module doc)."""
        marker = self._marker_file.read()
        if marker is None:
            if self._last_index > 0 or self._hard_state.term > 0:
                log.warning(
                    "Raft store %s has no marker %s, so a crash that cut its write-ahead "
                    "log short cannot be detected this once; the next save writes one",
                    self.path, self.marker_path,
                )  # fmt: skip
            return
        self._marker = marker
        hs = self._hard_state
        if marker.term == hs.term and None not in (marker.vote, hs.vote) and marker.vote != hs.vote:
            self._fail(
                f"it holds a vote for {_hex(hs.vote)} in term {hs.term}, but its marker "
                f"{self.marker_path} recorded a vote for {_hex(marker.vote)} in that term"
            )
        if marker.term > hs.term or (marker.term == hs.term and hs.vote is None and marker.vote):
            restored = HardState(term=marker.term, vote=marker.vote, commit=hs.commit)
            log.warning(
                "Raft store %s went back to term %d (vote %s); its marker %s "
                "recorded term %d (vote %s): restored from the marker, so this node cannot "
                "vote twice in a term",
                self.path, hs.term, _hex(hs.vote), self.marker_path, marker.term,
                _hex(marker.vote),
            )  # fmt: skip
            with self._transaction():
                self._write_hard_state(restored)
            self._hard_state = restored

        owed = []
        if not self._holds(marker.last):
            owed.append(marker.last)
        if marker.repair is not None and self._position() < marker.repair:
            owed.append(marker.repair)
        if not owed:
            return
        self._repair = self.damaged_until = owed_until = max(owed)
        now = self._position()
        log.warning(
            "Raft store %s is behind its marker %s: entries through index %d (term %d) "
            "were acknowledged, but the log now ends at index %d (term %d)%s. Its "
            "write-ahead log %s-wal lost them (cut short or damaged by a crash or a disk "
            "fault). This node joins as a follower that neither votes nor campaigns "
            "until a leader has repaired its log that far. If it was the only voter, no "
            "leader can: restore %s from a backup.",
            self.path, self.marker_path, owed_until.index, owed_until.term, now.index,
            now.term, "" if owed_until == marker.last else " (a repair left unfinished)",
            self.path, self.path,
        )  # fmt: skip

    def _position(self) -> LogPosition:
        """Where the log ends (the snapshot's position when nothing follows it)."""
        if self._last_index == self._snap_index:
            return LogPosition(term=self._snap_term, index=self._snap_index)
        term = self._db_term(self._last_index)
        if term is None:  # contiguity was verified on open and kept by save
            self._fail(f"log row {self._last_index} vanished while open")
        return LogPosition(term=term, index=self._last_index)

    def _holds(self, position: LogPosition) -> bool:
        """Whether the log still holds the entry at `position`, and so (Raft's
        log matching) everything before it. An index the snapshot covers is
        held: a snapshot only covers committed entries."""
        if position.index < self._snap_index:
            return True
        if position.index == self._snap_index:
            return position.term == self._snap_term
        if position.index > self._last_index:
            return False
        return self._db_term(position.index) == position.term

    # -- reading -------------------------------------------------------------

    def load(self) -> LoadedState:
        """Hard state, snapshot and every entry after it, for a restarting core,
        and how far a damaged log must be repaired (see `LoadedState`)."""
        return LoadedState(
            hard_state=self._hard_state,
            snapshot=self.snapshot(),
            entries=self.entries(self.first_index(), self._last_index + 1),
            damaged_until=self._repair,
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
        self._update_marker()

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

    def _update_marker(self) -> None:
        """After a commit: record where the log ends now, if that changed (module doc).

        A follower only saves entries a leader sent, and they end its log, so
        a saved log that reaches the repair position was repaired by a leader.
        """
        position = self._position()
        if self._repair is not None and position >= self._repair:
            log.info(
                "Raft store %s: the log reached index %d (term %d) from a leader; "
                "the repair that %s recorded is done",
                self.path, position.index, position.term, self.marker_path,
            )  # fmt: skip
            self._repair = None
        hs = self._hard_state
        marker = _Marker(last=position, repair=self._repair, term=hs.term, vote=hs.vote)
        if marker == self._marker:
            return
        try:
            self._marker_file.write(marker)
        except OSError as exc:
            raise StorageError(
                f"Raft store marker {self.marker_path} could not be written: {exc}"
            ) from exc
        self._marker = marker

    # -- closing -------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (sqlite checkpoints the WAL into the file). Idempotent."""
        self._marker_file.close()
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


def marker_path(path: Path) -> Path:
    """Where the marker of the store at `path` lives (module doc)."""
    return path.with_name(path.name + MARKER_SUFFIX)


def _hex(node: bytes | None) -> str:
    return "none" if node is None else node.hex()[:16]


def _bad_marker(path: Path, marker: Path, what: str) -> str:
    return (
        f"Raft store marker {marker} is unusable: {what}. It records how far the log of "
        f"{path} reached, so without it a log that lost acknowledged entries would look "
        "intact. Refusing to start: restore both from a backup, or remove the marker only "
        "if you know the store is intact (the next save writes a new one)."
    )


_datasync = getattr(os, "fdatasync", os.fsync)  # fdatasync is Linux-only


class _MarkerFile:
    """The marker on disk: two slots, written alternately in place.

    Created once atomically (temporary file, fsync, rename, fsync of the
    directory). After that each write overwrites the *older* slot and
    fdatasyncs it: one flush and no metadata change, where a rename per
    batch costs a file flush and a directory flush (measured on an ext4 VM
    disk, per batch: +0.12 ms against +0.4 ms on a 0.19 ms sqlite commit;
    +1.6 ms against +3.2 ms on 2.3 ms when the disk was busy). A crash
    mid-write can only spoil the slot being written; the other still holds
    the previous record, which covers everything acknowledged, because
    `save` returns, and the node acknowledges, only after the write. A slot
    that does not decode is said in a warning.
    """

    def __init__(self, db: Path) -> None:
        self.db = db
        self.path = marker_path(db)
        self._fd: int | None = None
        self._seq = 0

    def read(self) -> _Marker | None:
        """The newest readable slot; None if there is no marker; `StorageError` if none decodes."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(_bad_marker(self.db, self.path, f"cannot read it: {exc}")) from exc
        if len(data) != 2 * MARKER_SLOT:
            what = f"it is {len(data)} bytes long, not {2 * MARKER_SLOT}"
            raise StorageError(_bad_marker(self.db, self.path, what))
        records: list[tuple[int, _Marker]] = []
        problems: list[str] = []
        for slot in range(2):
            try:
                records.append(_Marker.decode(data[slot * MARKER_SLOT : (slot + 1) * MARKER_SLOT]))
            except ValueError as exc:
                problems.append(f"slot {slot}: {exc}")
        if not records:
            raise StorageError(_bad_marker(self.db, self.path, "; ".join(problems)))
        if problems:
            log.warning(
                "Raft store marker %s: %s (a write torn by a crash, or a damaged disk); "
                "using the other slot",
                self.path, problems[0],
            )  # fmt: skip
        self._seq, marker = max(records, key=lambda record: record[0])
        return marker

    def write(self, marker: _Marker) -> None:
        """Make `marker` the newest record, durably, before returning."""
        self._seq += 1
        record = marker.encode(self._seq)
        if self._fd is None:
            if not self.path.exists():
                tmp = self.path.with_name(self.path.name + ".creating")
                tmp.write_bytes(record + record)  # both slots: either is the newest
                replace_durably(tmp, self.path)
                self._fd = os.open(self.path, os.O_RDWR)
                return
            self._fd = os.open(self.path, os.O_RDWR)
        os.pwrite(self._fd, record, (self._seq % 2) * MARKER_SLOT)
        _datasync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
