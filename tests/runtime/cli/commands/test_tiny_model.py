"""`shardmesh tiny-model`: the folder and its manifest digest on stdout; a
model it cannot make is one line, exit 1 (the models: tests/runtime/model/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli.main import main
from runtime.model.manifest import load_manifest, manifest_digest


def test_it_prints_the_folder_and_the_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    assert main(["tiny-model", str(out), "--layers", "1", "--family", "llama"]) == 0
    folder, digest = capsys.readouterr().out.splitlines()
    assert Path(folder) == out
    assert digest == manifest_digest(load_manifest(out))
    assert load_manifest(out)["num_layers"] == 1


def test_a_model_it_cannot_make_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("in the way")
    assert main(["tiny-model", str(tmp_path / "file" / "tiny"), "--layers", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardmesh tiny-model: error: ") and err.count("\n") == 1
