"""Fixtures of the CLI tests: a hub model (`tests.fake_hub`) for `--model hf:REPO`.

`hub` serves `HUB_REPO` (the shared 8-layer tiny Llama in 2 weight files,
without its manifest, as a hub repository holds it) and points the CLI at it:
`runtime.cli.model_source.HUB_ENDPOINT` at the fake hub, the user cache
(where a hub model's folder goes) in the test's tmp dir.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from runtime.cli import model_source
from tests.fake_hub import FakeHub

HUB_REPO = "volunteers/tiny"
HUB_MODEL = f"hf:{HUB_REPO}"
HUB_METADATA = {"config.json", "tokenizer.json", "tokenizer_config.json"}
"""What a hub model's folder gets first (with the index): the tiny model
has no other tokenizer files."""


def shard_file(k: int, of: int = 2) -> str:
    """The k-th weight file: the first holds layers 0-3 and the embeddings."""
    return f"model-{k:05d}-of-{of:05d}.safetensors"


@pytest.fixture
def hub_built(llama_dir: Path) -> Path:
    """The hub model with its manifest: what `manifest build` makes of it."""
    return llama_dir


@pytest.fixture
def hub(hub_built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    repo = shutil.copytree(
        hub_built, tmp_path / "repo", ignore=shutil.ignore_patterns("shardmesh-*")
    )
    with serving(Path(repo), tmp_path, monkeypatch) as fake:
        yield fake


@contextmanager
def serving(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fake hub serving `repo` as `HUB_REPO`, the CLI pointed at it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with FakeHub({HUB_REPO: repo}) as fake:
        monkeypatch.setattr(model_source, "HUB_ENDPOINT", fake.url)
        yield fake


def hub_folder(tmp_path: Path) -> Path:
    """Where the `hub` fixture's model goes: its folder in the user cache."""
    return tmp_path / "cache" / "shardmesh" / "hub" / "volunteers" / "tiny@main"


def install_manifest_of(built: Path, folder: Path) -> None:
    """Put the model's manifest and goldens into a hub model's folder, as
    `manifest build hf:REPO` (or an operator's copy) would."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in built.glob("shardmesh-*"):
        shutil.copy(file, folder / file.name)
