"""Durable file replacement (`mesh.files.replace_durably`): the finished
temporary file takes the target's place whole, flushed to disk first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mesh.files import replace_durably


def test_the_new_content_replaces_the_old_and_the_temporary_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    tmp = tmp_path / "state.json.tmp"
    tmp.write_text("new")
    replace_durably(tmp, path)
    assert path.read_text() == "new"
    assert not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_first_write_creates_the_file(tmp_path: Path) -> None:
    tmp = tmp_path / "key.tmp"
    tmp.write_bytes(b"\x01\x02")
    replace_durably(tmp, tmp_path / "key")
    assert (tmp_path / "key").read_bytes() == b"\x01\x02"


def test_the_file_and_then_its_directory_are_flushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both fsyncs happen, the file's before the rename, the directory's after
    it (the directory holds the rename)."""
    path, tmp = tmp_path / "f", tmp_path / "f.tmp"
    tmp.write_text("x")
    synced: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        is_dir = os.path.isdir(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else False
        synced.append(("dir" if is_dir else "file", path.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    replace_durably(tmp, path)
    assert [renamed for _, renamed in synced] == [False, True]
    if os.path.isdir("/proc/self/fd"):
        assert [kind for kind, _ in synced] == ["file", "dir"]


def test_a_missing_temporary_raises_and_leaves_the_target_alone(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("kept")
    with pytest.raises(FileNotFoundError):
        replace_durably(tmp_path / "absent.tmp", path)
    assert path.read_text() == "kept"
