"""`--model`: a model folder, a GGUF file, or a model on the Hugging Face Hub (`hf:REPO`).

Every command that names a model (`node`, `serve`, `doctor`, `manifest
build`) reads it with `model_source`, so the forms mean the same in each
and a mistake reads the same. A hub model's files go to a folder in the
user cache, one per repository and revision (`default_hub_folder`; `serve`
takes another with MODEL_DIR): config, tokenizer and index first, then only
the weight files the command needs (`fetch_weights`, `runtime.model.hub`).
A `.gguf` file is imported once into the node's store (`gguf_folder`: under
its state dir, one folder per file; `runtime.model.gguf_import`), with
progress. From there on either is a model folder like any other.
"""

from __future__ import annotations

import hashlib
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
MODEL_METAVAR: Final = "DIR|FILE.gguf|hf:REPO[@REVISION]"
GGUF_SUFFIX: Final = ".gguf"
IMPORTED_DIR: Final = "models"
"""The folder of a node's state dir that holds the GGUF files it imported."""
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


def is_gguf(source: Path | HubSource | None) -> bool:
    """Whether `source` names a GGUF file (by its suffix: it may not exist)."""
    return isinstance(source, Path) and source.suffix.lower() == GGUF_SUFFIX


def gguf_folder(path: Path, state_dir: Path | None = None) -> Path:
    """Where the GGUF file `path` is (or will be) imported: a folder of
    `state_dir`'s store (default: the node's default state dir) named for
    the file and keyed by its path, size and modification time, so the
    same file is imported once and a changed one anew."""
    from runtime.node.state_dir import default_state_dir

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return (state_dir or default_state_dir()) / IMPORTED_DIR / f"{path.stem}-{digest}"


def model_folder(source: Path | HubSource, state_dir: Path | None = None) -> Path:
    """The folder that holds (or will hold) `source`'s files (a GGUF
    file's: in `state_dir`'s store, `gguf_folder`)."""
    if is_gguf(source) and isinstance(source, Path) and source.is_file():
        return gguf_folder(source, state_dir)
    return source if isinstance(source, Path) else default_hub_folder(source)


def fetch_model(
    source: Path | HubSource,
    command: str,
    *,
    folder: Path | None = None,
    state_dir: Path | None = None,
    name: str | None = None,
) -> Path:
    """The folder of `source`: a folder as it is (the command checks it);
    a GGUF file's import in `state_dir`'s store (`import_gguf_once`, the
    manifest's model `name` by default the file's); for a hub model,
    `folder` (default `default_hub_folder`) with what every use needs
    fetched: config, tokenizer, index. Raises HubError when the hub
    cannot give a file, ModelSourceError when a GGUF file cannot be read."""
    if is_gguf(source) and isinstance(source, Path):
        return import_gguf_once(source, command, state_dir, name)
    if isinstance(source, Path):
        return source
    folder = folder or default_hub_folder(source)
    folder.mkdir(parents=True, exist_ok=True)
    with _hub_model(source, folder, command) as model:
        model.fetch_metadata()
    return folder


def import_gguf_once(
    path: Path, command: str, state_dir: Path | None = None, name: str | None = None
) -> Path:
    """The model folder of the GGUF file `path`, imported into the node's
    store the first time (its phases shown as it goes); ModelSourceError
    when there is no such file or it is not a GGUF model transformers reads."""
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such GGUF file")
    folder = gguf_folder(path, state_dir)
    if folder.is_dir():
        return folder
    from runtime.model.gguf_import import import_gguf
    from runtime.model.progress import Progress

    folder.parent.mkdir(parents=True, exist_ok=True)
    with Progress(f"{PROG} {command}: importing {path.name}") as progress:
        try:
            import_gguf(path, folder, name or path.stem, progress)
        except (ValueError, KeyError, OSError) as exc:
            raise ModelSourceError(f"{path}: cannot import this GGUF file: {exc}") from None
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
