"""`--model`: a model folder, or a model on the Hugging Face Hub (`hf:REPO[@REVISION]`).

Every command that names a model (`node`, `serve`, `doctor`, `manifest
build`) reads it with `model_source`, so both forms mean the same in each
and a mistake reads the same. A hub model's files go to a folder in the
user cache, one per repository and revision (`default_hub_folder`; `serve`
takes another with MODEL_DIR): config, tokenizer and index first, then only
the weight files the command needs (`fetch_weights`, `runtime.model.hub`).
From there on it is a model folder like any other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Final

from runtime.cli.command import PROG

if TYPE_CHECKING:  # runtime.model.hub imports NumPy: only when a hub model is named
    from runtime.model.hub import HubModel, HubSource

HUB_PREFIX: Final = "hf:"
"""`runtime.model.hub.HUB_SCHEME`, spelled here so that reading a folder's
path imports nothing (tests/runtime/cli/test_model_source.py checks they agree)."""
MODEL_METAVAR: Final = "DIR|hf:REPO[@REVISION]"
HUB_ENDPOINT: str | None = None
"""The hub's URL; None: huggingface_hub's own ($HF_ENDPOINT). Tests point it
at `tests.fake_hub`."""
_REPO_ID: Final = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelSourceError(ValueError):
    """A hub model the command cannot use as named; the text is one line."""


def model_source(text: str) -> Path | HubSource:
    """argparse `type=` of every `--model`: `hf:OWNER/NAME[@REVISION]`, else
    a folder (a Path, so that a config file's is relative to the file)."""
    if not text.startswith(HUB_PREFIX):
        return Path(text)
    import argparse

    from runtime.model.hub import HubSource

    try:
        return HubSource.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def mistaken_hub_id(source: Path | HubSource | None) -> str | None:
    """The usage error for a folder that is not here but reads as a hub id
    (`Qwen/Qwen3-0.6B`, without `hf:`), else None: the command then reports
    a missing folder as it always has."""
    if not isinstance(source, Path) or source.exists() or source.is_absolute():
        return None
    text = str(source)
    if not _REPO_ID.fullmatch(text):
        return None
    return (
        f"argument --model: no folder {text!r} here, and {text!r} is not "
        f"hf:REPO[@REVISION] (the hub's model is hf:{text})"
    )


def default_hub_folder(source: HubSource) -> Path:
    """Where a hub model's files go when no folder is named: one folder per
    repository and revision in the user cache."""
    import platformdirs

    owner, name = source.repo.split("/", 1)
    return platformdirs.user_cache_path(PROG) / "hub" / owner / f"{name}@{source.revision}"


def model_folder(source: Path | HubSource) -> Path:
    """The folder that holds (or will hold) `source`'s files."""
    return source if isinstance(source, Path) else default_hub_folder(source)


def fetch_model(source: Path | HubSource, command: str, *, folder: Path | None = None) -> Path:
    """The folder of `source`: a folder as it is (the command checks it);
    for a hub model, `folder` (default `default_hub_folder`) with what
    every use needs fetched: config, tokenizer, index. Raises HubError
    when the hub cannot give a file."""
    if isinstance(source, Path):
        return source
    folder = folder or default_hub_folder(source)
    folder.mkdir(parents=True, exist_ok=True)
    with _hub_model(source, folder, command) as model:
        model.fetch_metadata()
    return folder


def require_manifest(source: Path | HubSource, folder: Path) -> None:
    """A hub model's shard is checked against a shardmesh manifest, which
    the hub does not hold: ModelSourceError, saying how to get one, when
    its folder has none (a folder's own is the doctor's to check)."""
    from runtime.model.manifest import MANIFEST_FILE

    if isinstance(source, Path) or (folder / MANIFEST_FILE).is_file():
        return
    text = source.text()
    raise ModelSourceError(
        f"{text}: no {PROG} manifest in {folder}; build it with `{PROG} manifest build "
        f"{text}` (fetches every weight file), or let `{PROG} serve --model {text}` take "
        "the swarm's"
    )


def fetch_weights(
    source: Path | HubSource, command: str, folder: Path, layers: tuple[int, int] | None = None
) -> None:
    """Put a hub model's weight files for `layers` (None: every layer) in
    its folder, after `fetch_model`; nothing for a folder. Raises HubError."""
    if isinstance(source, Path):
        return
    with _hub_model(source, folder, command) as model:
        if layers is None:
            model.fetch_all()
        else:
            model.fetch_span(*layers)


@contextmanager
def _hub_model(source: HubSource, folder: Path, command: str) -> Iterator[HubModel]:
    from runtime.model.hub import HubModel  # huggingface_hub and NumPy: only for a hub model
    from runtime.model.progress import Progress

    with Progress(f"{PROG} {command}") as progress:
        yield HubModel(source, folder, endpoint=HUB_ENDPOINT, progress=progress)
