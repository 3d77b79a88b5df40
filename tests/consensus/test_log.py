"""Raft log values: the entry kinds on disk and on the wire, and the order of
log positions that the election restriction and repair use."""

from __future__ import annotations

import pytest

from consensus.log import Entry, EntryKind, HardState, LogPosition


def test_entry_kinds_keep_their_numbers() -> None:
    """They are in every store and every AppendEntries: append-only."""
    assert {k.name: int(k) for k in EntryKind} == {"COMMAND": 1, "CONFIG": 2, "NOOP": 3}


def test_an_entry_carries_no_data_unless_given() -> None:
    assert Entry(1, 2, EntryKind.NOOP).data == b""
    assert HardState() == HardState(term=0, vote=None, commit=0)


@pytest.mark.parametrize(
    ("newer", "older"),
    [
        (LogPosition(term=3, index=1), LogPosition(term=2, index=100)),  # term first
        (LogPosition(term=2, index=5), LogPosition(term=2, index=4)),  # then index
    ],
)
def test_a_log_ending_in_a_later_term_is_more_up_to_date_whatever_its_length(
    newer: LogPosition, older: LogPosition
) -> None:
    assert newer > older and older < newer
    assert max(older, newer) == newer
    assert LogPosition(2, 4) >= LogPosition(2, 4)
