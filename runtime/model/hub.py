"""Model files from the Hugging Face Hub, fetched only as a shard needs them.

`shardmesh serve --model hf:REPO[@REVISION]` must not download a 70B
checkpoint to serve a tenth of it. `HubModel` fetches what every node needs
first (config.json, the tokenizer files, the index), then the weight files
span by span (`fetch_span`) once the swarm has said which layers this node
takes. The folder stays an ordinary model folder (its index lists only the
files on disk); the hub's whole index and the commit of every file are kept
apart in `HUB_STATE_DIR`, so a moving branch never mixes two versions.
huggingface_hub, imported only here, does the HTTP.

More: docs/design/models.md#fetching-from-the-hugging-face-hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from runtime.model.backends.base import BackendError
from runtime.model.manifest import TOKENIZER_FILES
from runtime.model.progress import Progress
from runtime.model.weights import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    read_config,
    tensor_names_for_shard,
)

HUB_SCHEME: Final = "hf:"
DEFAULT_REVISION: Final = "main"
HUB_STATE_DIR: Final = ".shardmesh-hub"
"""Inside the model folder: the hub's own index and the pinned commit
(`SOURCE_FILE`). Kept out of the folder's top level because the folder's
index there is the local one, listing only the files on disk."""
SOURCE_FILE: Final = "source.json"


class HubError(BackendError):
    """The hub could not give a file: no such repository, revision or
    file, no network, or offline mode. The text is one line for an operator."""


@dataclass(frozen=True)
class HubSource:
    """`hf:REPO[@REVISION]`: a model repository on the hub, at a branch, tag
    or commit."""

    repo: str
    revision: str = DEFAULT_REVISION

    @classmethod
    def parse(cls, text: str) -> HubSource:
        """`hf:owner/name[@revision]`; ValueError for anything else."""
        if not text.startswith(HUB_SCHEME):
            raise ValueError(f"{text!r} is not hf:REPO[@REVISION] (e.g. hf:Qwen/Qwen3-0.6B)")
        repo, at, revision = text.removeprefix(HUB_SCHEME).partition("@")
        owner, slash, name = repo.partition("/")
        if not (owner and slash and name) or "/" in name or (at and not revision):
            raise ValueError(f"{text!r} is not hf:OWNER/NAME[@REVISION] (e.g. hf:Qwen/Qwen3-0.6B)")
        return cls(repo, revision or DEFAULT_REVISION)

    @property
    def name(self) -> str:
        """The repository's own name: the model's name in the swarm when
        this node is the first to bring it."""
        return self.repo.rsplit("/", 1)[-1]

    def text(self) -> str:
        return f"{HUB_SCHEME}{self.repo}@{self.revision}"


class HubModel:
    """One model folder filled from one hub repository at one commit.

    Blocking (HTTP and disk): a node calls it in a worker thread. It is the
    store's `WeightSource` for the folder (`runtime.model.store`)."""

    def __init__(
        self,
        source: HubSource,
        folder: Path,
        *,
        endpoint: str | None = None,
        progress: Progress | None = None,
    ) -> None:
        """`endpoint`: the hub's URL (None: huggingface_hub's, from
        `HF_ENDPOINT`); `progress` hears of each file fetched."""
        self.source = source
        self.folder = Path(folder)
        self.endpoint = endpoint
        self.progress = progress
        self._commit: str | None = None
        self._weight_map: dict[str, str] | None = None

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> weight file, from the hub's index (`fetch_metadata` first)."""
        if self._weight_map is None:
            self._load_state()
        assert self._weight_map is not None
        return self._weight_map

    def tensor_names(self) -> list[str]:
        """Every tensor of the checkpoint, as the hub's index lists them."""
        return sorted(self.weight_map)

    def fetch_metadata(self) -> None:
        """What every node of the model needs whatever span it serves:
        config.json, the tokenizer files the repository has, and the index
        (or the one weights file of an unsharded checkpoint). Pins the
        revision to the commit it resolves to now."""
        commit = self._resolve_commit()
        state = self.folder / HUB_STATE_DIR
        if self.progress:
            self.progress.phase(f"fetching config and tokenizer from {self.source.text()}")
        self._download(CONFIG_FILE, commit, self.folder)
        for name in TOKENIZER_FILES:
            self._download(name, commit, self.folder, optional=True)
        index = self._download(INDEX_FILE, commit, state, optional=True)
        if index is None:  # one file holds every layer: there is no part to choose
            for stale in (state / INDEX_FILE, self.folder / INDEX_FILE):  # an earlier commit's
                stale.unlink(missing_ok=True)
            self._download(SINGLE_FILE, commit, self.folder)
            weight_map = dict.fromkeys(_single_file_names(self.folder / SINGLE_FILE), SINGLE_FILE)
        else:
            weight_map = _read_weight_map(index)
        _write_json(
            state / SOURCE_FILE,
            {"repo": self.source.repo, "revision": self.source.revision, "commit": commit},
        )
        self._commit, self._weight_map = commit, weight_map

    def files_for_span(self, start: int, end: int) -> list[str]:
        """The weight files that hold a tensor shard [start, end) needs
        (`runtime.model.weights.tensor_names_for_shard`: its layers, plus the
        embeddings on the first shard and the final norm and LM head on the
        last). A tensor the index lacks is left to the doctor to name."""
        config = read_config(self.folder)
        names = tensor_names_for_shard(config, start, end)
        return sorted({self.weight_map[name] for name in names if name in self.weight_map})

    def fetch_span(self, start: int, end: int) -> list[str]:
        """Put the weight files shard [start, end) needs on disk; those files."""
        return self._fetch_files(self.files_for_span(start, end), f"layers {start}:{end}")

    def fetch_all(self) -> list[str]:
        """Put every weight file on disk (what building a manifest reads)."""
        return self._fetch_files(sorted(set(self.weight_map.values())), "every layer")

    def _fetch_files(self, files: list[str], what: str) -> list[str]:
        """Each file at the pinned commit: huggingface_hub keeps one already
        fetched at that commit without asking the hub, and fetches it again
        if an earlier run fetched it at another."""
        if self.progress:
            total = len(set(self.weight_map.values()))
            self.progress.phase(f"weight files for {what}: {len(files)} of {total}", len(files))
        commit = self._commit or self._load_state()
        for name in files:
            self._download(name, commit, self.folder)
            if self.progress:
                self.progress.advance()
        self._write_local_index()
        return files

    def _write_local_index(self) -> None:
        """The folder's own index: the tensors of the weight files on disk."""
        files = set(self.weight_map.values())
        if files == {SINGLE_FILE}:
            return  # an unsharded checkpoint needs no index
        present = {name for name in files if (self.folder / name).is_file()}
        weight_map = {t: f for t, f in sorted(self.weight_map.items()) if f in present}
        _write_json(self.folder / INDEX_FILE, {"metadata": {}, "weight_map": weight_map})

    def _load_state(self) -> str:
        """The commit and weight map a previous `fetch_metadata` pinned."""
        state = self.folder / HUB_STATE_DIR
        try:
            source = json.loads((state / SOURCE_FILE).read_text())
            commit = str(source["commit"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HubError(f"{state / SOURCE_FILE}: no fetched metadata ({exc})") from None
        index = state / INDEX_FILE
        if index.is_file():
            self._weight_map = _read_weight_map(index)
        else:
            names = _single_file_names(self.folder / SINGLE_FILE)
            self._weight_map = dict.fromkeys(names, SINGLE_FILE)
        self._commit = commit
        return commit

    def _resolve_commit(self) -> str:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(
            self.source.repo, CONFIG_FILE, revision=self.source.revision, endpoint=self.endpoint
        )
        with _hub_errors(self.source, CONFIG_FILE):
            metadata = get_hf_file_metadata(url, endpoint=self.endpoint)
        if not metadata.commit_hash:
            raise HubError(f"{self.source.text()}: the hub named no commit for {CONFIG_FILE}")
        return str(metadata.commit_hash)

    def _download(
        self, name: str, commit: str, into: Path, *, optional: bool = False
    ) -> Path | None:
        """Fetch `name` at `commit` into the folder `into` (kept when already
        fetched at that commit); None when `optional` and the repository
        has no such file."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RemoteEntryNotFoundError

        try:
            with _hub_errors(self.source, name):
                path = hf_hub_download(
                    self.source.repo,
                    name,
                    revision=commit,
                    local_dir=into,
                    endpoint=self.endpoint,
                    tqdm_class=_quiet_tqdm(),
                )
        except HubError as exc:
            if optional and isinstance(exc.__cause__, RemoteEntryNotFoundError):
                return None
            raise
        return Path(str(path))


@contextmanager
def _hub_errors(source: HubSource, name: str) -> Iterator[None]:
    """Turn whatever huggingface_hub raises while fetching `name` into a
    one-line HubError (the original stays as its `__cause__`): the call
    inside is the library's alone, and every way it fails is the hub's."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except Exception as exc:
        if isinstance(exc, RepositoryNotFoundError):
            why = "no such repository on the hub (or it is private or gated: set HF_TOKEN)"
        elif isinstance(exc, RevisionNotFoundError):
            why = f"the repository has no revision {source.revision!r}"
        elif isinstance(exc, OfflineModeIsEnabled):
            why = "HF_HUB_OFFLINE is set: the hub may not be asked"
        elif isinstance(exc, LocalEntryNotFoundError):  # the hub did not answer
            why = f"cannot reach the hub for {name}: {_first_line(exc)}"
        elif isinstance(exc, EntryNotFoundError):
            why = f"the repository has no file {name}"
        else:
            why = f"fetching {name} failed: {_first_line(exc)}"
        raise HubError(f"{source.text()}: {why}") from exc


def _quiet_tqdm() -> type:
    """huggingface_hub draws a bar per file; the node logs its own progress
    line per file instead (`Progress`), so the library's bars stay off."""
    from tqdm import tqdm

    class Quiet(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HubError(f"{index}: unreadable safetensors index: {exc}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
        for k, v in weight_map.items()
    ):
        raise HubError(f"{index}: the weight map must name files in the repository's top folder")
    return weight_map


def _single_file_names(path: Path) -> list[str]:
    from runtime.model.weights import SafetensorsReader

    return SafetensorsReader(path.parent).names()


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
