"""`runtime.cli.model_source`: `--model` as a folder or `hf:REPO`, and what a
hub model's folder gets fetched for each use (against `tests.fake_hub`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from runtime.cli.model_source import (
    HUB_PREFIX,
    ModelSourceError,
    default_hub_folder,
    fetch_model,
    fetch_weights,
    mistaken_hub_id,
    model_folder,
    model_source,
    require_manifest,
)
from runtime.model.hub import HUB_SCHEME, HubSource
from runtime.model.weights import INDEX_FILE
from tests.fake_hub import FakeHub
from tests.runtime.cli.conftest import (
    HUB_METADATA,
    HUB_MODEL,
    hub_folder,
    install_manifest_of,
    shard_file,
)


def test_a_model_is_a_folder_or_a_hub_repository() -> None:
    assert HUB_PREFIX == HUB_SCHEME
    assert model_source("models/tiny") == Path("models/tiny")
    assert model_source("hf:Qwen/Qwen3-0.6B@v1") == HubSource("Qwen/Qwen3-0.6B", "v1")
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        model_source("hf:Qwen")
    with pytest.raises(ValueError) as parsed:
        HubSource.parse("hf:Qwen")
    assert str(refused.value) == str(parsed.value)  # the hub's own words, in every command


def test_a_missing_folder_that_reads_as_a_hub_id_says_to_write_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    message = mistaken_hub_id(Path("Qwen/Qwen3-0.6B"))
    assert message is not None
    assert "'Qwen/Qwen3-0.6B' is not hf:REPO[@REVISION]" in message
    assert "hf:Qwen/Qwen3-0.6B" in message
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert mistaken_hub_id(Path("Qwen/Qwen3-0.6B")) is None  # a folder after all
    for other in (Path("nowhere"), tmp_path / "a" / "b", Path("a/b/c"), None):
        assert mistaken_hub_id(other) is None
    assert mistaken_hub_id(HubSource("a/b")) is None


def test_a_hub_model_has_a_folder_per_revision_in_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = default_hub_folder(HubSource("Qwen/Qwen3-0.6B", "v1"))
    assert folder == tmp_path / "shardmesh" / "hub" / "Qwen" / "Qwen3-0.6B@v1"
    assert model_folder(HubSource("Qwen/Qwen3-0.6B", "v1")) == folder
    assert model_folder(Path("here")) == Path("here")


def test_a_folder_is_used_as_it_is(tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    assert fetch_model(nowhere, "node") == nowhere
    require_manifest(nowhere, nowhere)  # the doctor's to check
    fetch_weights(nowhere, "node", nowhere, (0, 2))
    assert not nowhere.exists()


def test_a_shard_of_a_hub_model_needs_its_manifest_before_any_weights(
    hub: FakeHub, hub_built: Path, tmp_path: Path
) -> None:
    source = model_source(HUB_MODEL)
    folder = fetch_model(source, "node")
    assert folder == hub_folder(tmp_path)
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE}
    with pytest.raises(ModelSourceError) as refused:
        require_manifest(source, folder)
    assert str(refused.value) == (
        f"hf:volunteers/tiny@main: no shardmesh manifest in {folder}; build it with "
        "`shardmesh manifest build hf:volunteers/tiny@main` (fetches every weight file), or "
        "let `shardmesh serve --model hf:volunteers/tiny@main` take the swarm's"
    )
    install_manifest_of(hub_built, folder)
    require_manifest(source, folder)
    fetch_weights(source, "node", folder, (0, 2))
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE, shard_file(1)}


def test_every_layer_and_another_folder(hub: FakeHub, tmp_path: Path) -> None:
    source = model_source(HUB_MODEL)
    mine = tmp_path / "mine"
    assert fetch_model(source, "serve", folder=mine) == mine  # the metadata only
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE}
    fetch_weights(source, "manifest build", mine)
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE} | {shard_file(k) for k in (1, 2)}
    assert sorted(p.name for p in mine.glob("model-*")) == [shard_file(k) for k in (1, 2)]
