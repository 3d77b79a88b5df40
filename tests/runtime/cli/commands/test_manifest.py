"""`shardmesh manifest build` of a hub model: every weight file fetched into
its folder in the user cache, the manifest written there (a folder's build:
tests/runtime/model/test_progress.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli.main import main
from runtime.model.manifest import load_manifest, manifest_digest
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import INDEX_FILE
from tests.runtime.cli.conftest import HUB_METADATA, HUB_MODEL, hub_folder, serving, shard_file


def test_a_hub_models_manifest_is_built_in_its_cached_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = make_tiny_model(tmp_path / "repo", layers=2, shards=2, with_manifest=False)
    with serving(repo, tmp_path, monkeypatch) as hub:
        assert main(["manifest", "build", HUB_MODEL, "--name", "tiny"]) == 0
    digest = capsys.readouterr().out.strip()
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE, shard_file(1), shard_file(2)}
    manifest = load_manifest(hub_folder(tmp_path))  # where node and doctor look for it
    assert manifest_digest(manifest) == digest and manifest["name"] == "tiny"


def test_a_missing_folder_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["manifest", "build", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err == (
        f"shardmesh manifest build: error: no directory at {tmp_path / 'nowhere'}\n"
    )
