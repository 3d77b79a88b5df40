"""A WAL damaged by kill -9 or a disk fault is detected, never silently trusted.

sqlite drops every write-ahead-log frame from the first torn, missing or
bit-flipped one on, and then opens cleanly with an older store. The marker
beside the database (consensus.storage, module doc) is what notices.

The crash is real: a child process writes batches through `RaftStorage` and
is killed with SIGKILL, so its directory holds exactly what kill -9 leaves
(the main file, which holds only the schema: every batch is still in the
`-wal`, plus the `-shm` and the marker). Each test copies that directory and
damages the copy the way a crash mid-write or a disk fault would; no sqlite
behaviour is mocked. Every outcome must be one of three, and never "opened,
just older": the store is complete; or it says how far it must be repaired
(`damaged_until`) in a warning naming the database, the marker and the
indexes; or it refuses with a `StorageError` naming the file.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from consensus.config import ConsensusConfig
from consensus.log import Entry, EntryKind, HardState, LogPosition, Snapshot
from consensus.storage import (
    MARKER_SLOT,
    LoadedState,
    RaftStorage,
    StorageError,
    _hard_state_crc,
    marker_path,
)
from runtime.node.raft_driver import RaftDriver
from tests import REPO

A, B = b"a" * 32, b"b" * 32
STORE = "raft.sqlite3"
BATCHES = 10
PER_BATCH = 5
LAST = LogPosition(term=3, index=BATCHES * PER_BATCH)
"""Where the child's log ends when it is killed."""
FINAL_HARD_STATE = HardState(term=4, vote=B, commit=LAST.index - PER_BATCH)
"""The child's last batch is a vote alone (a new election), so it can be lost on its own."""
WAL_HEADER = 32
FRAME = 24 + 4096
"""sqlite's WAL: a 32-byte header, then frames of a 24-byte header and one 4 KiB page."""


def batch_term(batch: int) -> int:
    return 1 + batch // 4


def expected_entries() -> list[Entry]:
    return [
        Entry(batch_term(b), i, EntryKind.COMMAND, i.to_bytes(4, "big") * 25)
        for b in range(1, BATCHES + 1)
        for i in range((b - 1) * PER_BATCH + 1, b * PER_BATCH + 1)
    ]


def write_batches(store: RaftStorage) -> None:
    """What the child commits before it is killed: one fsync'd save per batch."""
    entries = expected_entries()
    for b in range(1, BATCHES + 1):
        batch = entries[(b - 1) * PER_BATCH : b * PER_BATCH]
        store.save(HardState(batch_term(b), A, batch[0].index - 1), batch, None)
    assert batch_term(BATCHES) == LAST.term
    store.save(FINAL_HARD_STATE, [], None)


CHILD = """
import os, signal, sys
from pathlib import Path
from consensus.storage import RaftStorage
from tests.consensus.test_storage_wal_damage import write_batches
store = RaftStorage.open(Path(sys.argv[1]))
write_batches(store)
os.kill(os.getpid(), signal.SIGKILL)  # no close: nothing is checkpointed
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state directory of a process killed with SIGKILL right after its last save."""
    folder = tmp_path_factory.mktemp("killed")
    root = REPO
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder / STORE)], cwd=root, capture_output=True
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    wal = folder / f"{STORE}-wal"
    assert wal.stat().st_size > WAL_HEADER + 10 * FRAME, "the batches should be in the WAL"
    return folder


@pytest.fixture
def copy(killed: Path, tmp_path: Path) -> Path:
    """A fresh copy of the killed process's directory; returns the database path."""
    target = tmp_path / "state"
    shutil.copytree(killed, target)
    return target / STORE


def wal_of(db: Path) -> Path:
    return Path(f"{db}-wal")


@dataclass
class Outcome:
    state: LoadedState | None
    error: StorageError | None
    warnings: list[str]


def open_after(db: Path, caplog: pytest.LogCaptureFixture) -> Outcome:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardmesh.raft.storage"):
        try:
            with RaftStorage.open(db) as store:
                state = store.load()
        except StorageError as exc:
            return Outcome(None, exc, [])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return Outcome(state, None, warnings)


def damaged_until(db: Path, caplog: pytest.LogCaptureFixture) -> LogPosition | None:
    state = open_after(db, caplog).state
    assert state is not None
    return state.damaged_until


def assert_not_silent(db: Path, outcome: Outcome) -> None:
    """The contract: complete, or damage reported with how far to repair, or refused."""
    if outcome.error is not None:
        message = str(outcome.error)
        assert str(db) in message or str(marker_path(db)) in message, message
        return
    state = outcome.state
    assert state is not None
    # A damaged marker slot is said; then the older slot's record is used.
    slot_lost = any(
        "using the other slot" in w and str(marker_path(db)) in w for w in outcome.warnings
    )
    if not slot_lost:
        # A lost term or vote is restored from the marker, never forgotten.
        assert (state.hard_state.term, state.hard_state.vote) == (4, B)
    expected = expected_entries()
    # Whatever survived is the real log's prefix, never garbage.
    assert list(state.entries) == expected[: len(state.entries)]
    if len(state.entries) == len(expected):
        assert state.damaged_until is None
    else:
        assert state.damaged_until == LAST
        (line,) = [w for w in outcome.warnings if "is behind its marker" in w]
        last = len(state.entries)
        for part in (str(db), str(marker_path(db)), f"index {LAST.index} (term {LAST.term})"):
            assert part in line, (part, line)
        assert f"now ends at index {last} " in line, line


# -- the undamaged crash -----------------------------------------------------------


def test_kill_9_with_an_intact_wal_loses_nothing(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outcome = open_after(copy, caplog)
    assert outcome.error is None and outcome.state is not None
    assert outcome.state.entries == tuple(expected_entries())
    assert outcome.state.hard_state == FINAL_HARD_STATE
    assert outcome.state.damaged_until is None
    assert outcome.warnings == []


# -- a WAL cut short: a torn tail after kill -9 or power loss -----------------------

CUTS: dict[str, Callable[[int], int]] = {
    "empty": lambda size: 0,
    "torn_header": lambda size: WAL_HEADER // 2,
    "header_only": lambda size: WAL_HEADER,
    "one_frame": lambda size: WAL_HEADER + FRAME,
    "mid_frame": lambda size: WAL_HEADER + 5 * FRAME + 100,
    "frame_header_torn": lambda size: WAL_HEADER + 9 * FRAME + 10,
    "half": lambda size: size // 2,
    "last_batch_torn": lambda size: size - FRAME - 7,
    "vote_frame_gone": lambda size: size - FRAME,
    "vote_frame_torn": lambda size: size - 1,
}
VOTE_ONLY = {"vote_frame_gone", "vote_frame_torn"}
"""Cuts inside the last frame: the final, vote-only batch."""


@pytest.mark.parametrize("cut", CUTS)
def test_wal_cut_short_is_detected(copy: Path, caplog: pytest.LogCaptureFixture, cut: str) -> None:
    wal = wal_of(copy)
    size = wal.stat().st_size
    with wal.open("r+b") as f:
        f.truncate(CUTS[cut](size))
    outcome = open_after(copy, caplog)
    assert_not_silent(copy, outcome)
    assert outcome.error is None and outcome.state is not None
    if cut in VOTE_ONLY:
        # Only the final vote was lost: the log is whole, the vote restored.
        assert outcome.state.damaged_until is None
        assert any("went back to term" in w for w in outcome.warnings)
    else:
        assert outcome.state.damaged_until == LAST


def test_deleted_wal_is_detected(copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    wal_of(copy).unlink()
    Path(f"{copy}-shm").unlink()
    outcome = open_after(copy, caplog)
    assert_not_silent(copy, outcome)
    assert outcome.state is not None and outcome.state.entries == ()
    assert outcome.state.damaged_until == LAST


# -- a flipped bit: sqlite's frame checksum fails and it drops from there -------------


@pytest.mark.parametrize("seed", range(12))
def test_flipped_byte_in_the_wal_is_detected(
    copy: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    rng = random.Random(seed)
    wal = wal_of(copy)
    data = bytearray(wal.read_bytes())
    # Seed 0 hits the WAL header, seed 1 a frame header, the rest anywhere.
    if seed == 0:
        at = rng.randrange(WAL_HEADER)
    elif seed == 1:
        at = WAL_HEADER + 3 * FRAME + rng.randrange(24)
    else:
        at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    wal.write_bytes(bytes(data))
    outcome = open_after(copy, caplog)
    assert_not_silent(copy, outcome)
    assert outcome.error is None and outcome.state is not None
    if at < len(data) - FRAME:  # anything before the last (vote-only) frame loses entries
        assert outcome.state.damaged_until == LAST


@pytest.mark.parametrize("seed", range(30))
def test_random_damage_is_never_silent(
    copy: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    """One to three faults anywhere in the WAL, the main file or the marker."""
    rng = random.Random(1000 + seed)
    for _ in range(rng.randint(1, 3)):
        victim = rng.choice([wal_of(copy), wal_of(copy), copy, marker_path(copy)])
        if not victim.exists():
            continue
        data = bytearray(victim.read_bytes())
        if rng.random() < 0.4 and victim != marker_path(copy):
            del data[rng.randrange(len(data) + 1) :]
        elif data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
    assert_not_silent(copy, open_after(copy, caplog))


# -- what sqlite or the marker refuse outright -------------------------------------------


def test_wal_without_its_database_is_refused(copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fresh file would take the orphaned WAL's frames as its own."""
    copy.unlink()
    outcome = open_after(copy, caplog)
    assert outcome.error is not None
    assert str(copy) in str(outcome.error) and "write-ahead log" in str(outcome.error)
    assert not copy.exists()


def test_database_and_wal_both_gone_start_in_repair(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The marker still says what was promised: the node may not vote as if new."""
    copy.unlink()
    wal_of(copy).unlink()
    outcome = open_after(copy, caplog)
    assert_not_silent(copy, outcome)
    assert outcome.state is not None and outcome.state.damaged_until == LAST


@pytest.mark.parametrize(
    "content",
    [b"", b"{}", b"not json\n", b'{"format": 1, "crc": 0}', b"\0" * (2 * MARKER_SLOT)],
    ids=["empty", "object", "text", "short_record", "blank_slots"],
)
def test_unreadable_marker_is_refused(
    copy: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    marker_path(copy).write_bytes(content)
    outcome = open_after(copy, caplog)
    assert outcome.error is not None
    assert str(marker_path(copy)) in str(outcome.error)


def test_edited_marker_is_refused(copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = marker_path(copy)
    marker.write_bytes(marker.read_bytes().replace(b'"last_index": 50', b'"last_index": 51'))
    outcome = open_after(copy, caplog)
    assert outcome.error is not None
    assert "checksum mismatch" in str(outcome.error)


def newest_slot(marker: Path) -> int:
    data = marker.read_bytes()
    seqs = [
        json.loads(data[i * MARKER_SLOT : (i + 1) * MARKER_SLOT].rstrip(b"\0"))["seq"]
        for i in (0, 1)
    ]
    return seqs.index(max(seqs))


def test_a_torn_marker_slot_is_a_warning_and_the_other_slot_is_used(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Power lost mid-write: the slot being written is garbage, the older one intact."""
    marker = marker_path(copy)
    data = bytearray(marker.read_bytes())
    slot = newest_slot(marker)
    data[slot * MARKER_SLOT + 10 : slot * MARKER_SLOT + 600] = b"\0" * 590
    marker.write_bytes(bytes(data))
    outcome = open_after(copy, caplog)
    assert outcome.state is not None and outcome.state.damaged_until is None
    assert outcome.state.hard_state == FINAL_HARD_STATE
    (line,) = outcome.warnings
    assert str(marker) in line and f"slot {slot}" in line
    with RaftStorage.open(copy) as store:  # the next write takes the spoiled slot
        store.save(None, [Entry(4, LAST.index + 1, EntryKind.NOOP)], None)
    assert newest_slot(marker) == slot
    assert open_after(copy, caplog).warnings == []


def test_missing_marker_is_a_warning_and_the_next_save_writes_one(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store from before markers existed: nothing to compare, said once."""
    marker_path(copy).unlink()
    outcome = open_after(copy, caplog)
    assert outcome.state is not None and outcome.state.damaged_until is None
    (line,) = outcome.warnings
    assert str(copy) in line and str(marker_path(copy)) in line
    with RaftStorage.open(copy) as store:
        store.save(None, [Entry(4, LAST.index + 1, EntryKind.NOOP)], None)
    assert marker_path(copy).exists()
    assert open_after(copy, caplog).warnings == []


def test_conflicting_votes_in_one_term_are_refused(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store and its marker hold different votes in term 4: one of them lies."""
    vote = b"c" * 32
    conn = sqlite3.connect(copy)  # a second connection, as a buggy tool would
    with conn:
        conn.execute(
            "UPDATE hard_state SET vote = ?, crc = ?",
            (vote, _hard_state_crc(4, vote, FINAL_HARD_STATE.commit)),
        )
    conn.close()
    outcome = open_after(copy, caplog)
    assert outcome.error is not None
    assert str(copy) in str(outcome.error) and "recorded a vote for" in str(outcome.error)


# -- the repair debt ----------------------------------------------------------------------


def test_repair_debt_survives_restarts_until_a_leader_pays_it(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with wal_of(copy).open("r+b") as f:
        f.truncate(wal_of(copy).stat().st_size // 2)
    first = open_after(copy, caplog)
    assert first.state is not None and first.state.damaged_until == LAST
    kept = len(first.state.entries)
    assert kept < 30
    expected = expected_entries()
    # The term-3 leader resends part of what was lost; the node crashes mid-repair.
    with RaftStorage.open(copy) as store:
        store.save(None, expected[kept:30], None)
        assert store.load().damaged_until == LAST
    again = open_after(copy, caplog)
    assert again.state is not None and len(again.state.entries) == 30
    assert again.state.damaged_until == LAST, "the debt must not be forgotten"
    # The rest arrives: repaired, and a restart is a normal one again.
    with RaftStorage.open(copy) as store:
        store.save(None, expected[30:], None)
        assert store.load().damaged_until is None
    done = open_after(copy, caplog)
    assert done.state is not None and done.state.damaged_until is None
    assert done.warnings == []


def test_a_newer_leaders_entry_repairs_a_log_it_does_not_reach_in_length(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(term, index) order: entry 40 of term 5 is more up to date than 50 of term 3."""
    with wal_of(copy).open("r+b") as f:
        f.truncate(WAL_HEADER + 3 * FRAME)
    outcome = open_after(copy, caplog)
    assert outcome.state is not None and outcome.state.damaged_until == LAST
    kept = len(outcome.state.entries)
    expected = expected_entries()
    with RaftStorage.open(copy) as store:
        store.save(None, [*expected[kept:39], Entry(5, 40, EntryKind.NOOP)], None)
        assert store.load().damaged_until is None
    assert damaged_until(copy, caplog) is None


def test_a_leaders_snapshot_repairs(copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    wal_of(copy).unlink()
    assert damaged_until(copy, caplog) == LAST
    with RaftStorage.open(copy) as store:
        store.save(None, [], Snapshot(LAST.index, LAST.term, frozenset({A, B}), frozenset(), b""))
        assert store.load().damaged_until is None
    assert damaged_until(copy, caplog) is None


# -- the driver ---------------------------------------------------------------------------


def test_a_damaged_store_starts_the_driver_in_repair(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wal_of(copy).unlink()  # the configuration went with it
    with RaftStorage.open(copy) as store:
        driver = RaftDriver(
            node_id=A,
            storage=store,
            config=ConsensusConfig.local(),
            bootstrap=True,
            send=lambda to, payload: None,
            members=lambda: (),
            rng=random.Random(0),
        )
        raft = driver.status()["raft"]
        assert raft["repairing_until"] == LAST.index
        # bootstrap=True, yet it does not found a one-voter cluster of its own
        # (which would lead at once) with everything it acknowledged gone.
        assert raft["voters"] == []
        driver.raft.campaign()
        assert not driver.raft.is_leader and driver.raft.term == FINAL_HARD_STATE.term
