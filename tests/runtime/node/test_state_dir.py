"""What a node keeps on disk: the lock, incarnations and record seqs that only
go up, and the ready file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.node.state_dir import MAX_SANE_COUNTER, StateDir, StateDirError, read_ready


def test_incarnation_and_record_seq_continue_across_runs(tmp_path: Path) -> None:
    with StateDir(tmp_path) as state:
        assert state.next_incarnation() == 0
        assert state.record_seq() == 0
        state.store_incarnation(4)  # a refutation during the run
        state.store_record_seq(3)
        state.store_incarnation(2)  # never goes down
    with StateDir(tmp_path) as state:
        assert state.next_incarnation() == 5
        assert state.record_seq() == 3


def test_one_process_per_state_dir(tmp_path: Path) -> None:
    with StateDir(tmp_path), pytest.raises(StateDirError, match="in use"):
        StateDir(tmp_path)
    StateDir(tmp_path).close()  # free again once closed


def test_corrupt_counter_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "incarnation").write_text("seven\n")
    with StateDir(tmp_path) as state, pytest.raises(StateDirError, match="corrupt"):
        state.next_incarnation()


def test_an_absurd_counter_is_an_error_naming_the_file(tmp_path: Path) -> None:
    # What a forged death at incarnation 2**63 - 1 would have pushed a node
    # to, had it been refuted and stored: starting from it, the node could
    # never outbid the next accusation.
    (tmp_path / "incarnation").write_text(f"{2**63 - 2}\n")
    with StateDir(tmp_path) as state, pytest.raises(StateDirError) as refused:
        state.next_incarnation()
    assert str(tmp_path / "incarnation") in str(refused.value)
    assert "beyond anything a node reaches" in str(refused.value)
    (tmp_path / "incarnation").write_text(f"{MAX_SANE_COUNTER}\n")  # the limit itself is fine
    with StateDir(tmp_path) as state:
        assert state.next_incarnation() == MAX_SANE_COUNTER + 1


def test_ready_file_is_per_process_and_cleared(tmp_path: Path) -> None:
    with StateDir(tmp_path) as state:
        assert read_ready(tmp_path) is None
        state.write_ready({"api": "http://127.0.0.1:1"})
        assert read_ready(tmp_path, os.getpid()) == {
            "api": "http://127.0.0.1:1",
            "pid": os.getpid(),
        }
        assert read_ready(tmp_path, os.getpid() + 1) is None
    assert read_ready(tmp_path) is None
