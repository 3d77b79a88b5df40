"""Raft log values shared by the core, its storage and the state machine.

Plain immutable values, no I/O: the sans-IO core (`consensus.raft`) produces
them, storage (`consensus.storage`) persists them, the placement ledger
(`consensus.ledger`) applies committed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class EntryKind(IntEnum):
    """What an entry carries. Values are on the wire and on disk: append-only."""

    COMMAND = 1
    """An opaque state-machine command (a placement ledger command)."""
    CONFIG = 2
    """A membership change: `data` encodes the new voter and learner sets."""
    NOOP = 3
    """Appended by a new leader so it can commit entries of earlier terms."""


@dataclass(frozen=True, slots=True)
class Entry:
    term: int
    index: int
    kind: EntryKind
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be on disk before any message that depends on it is sent."""

    term: int = 0
    vote: bytes | None = None
    commit: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state machine at `index` (of `term`), with the configuration then."""

    index: int
    term: int
    voters: frozenset[bytes]
    learners: frozenset[bytes]
    data: bytes


@dataclass(frozen=True, slots=True, order=True)
class LogPosition:
    """Where a log ends: the last entry's term and index.

    Ordered by term, then index: the order Raft's election restriction
    (paper §5.4.1) uses to decide which of two logs is more up to date, so
    `a >= b` reads "a log ending at `a` is at least as up to date as one
    ending at `b`". Used to say how far a damaged log must be repaired.
    """

    term: int
    index: int
