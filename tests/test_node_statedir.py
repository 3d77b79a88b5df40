"""What a node keeps on disk: the lock, incarnations and record seqs that only
go up, and the ready file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.node.state_dir import StateDir, StateDirError, read_ready


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
