"""A node's local model store (`--models STORE`): models it may be asked to load.

A store is a folder of model directories, each with its manifest
(`shardmesh manifest build DIR`, or made by `shardmesh tiny-model`). A model
is known by its manifest's name; the node advertises the names in its
signed record, and the placement leader may assign it a span of any of
them. The manifest also gives the sizes placement needs (`model_facts`), so
the leader can size shards for a model no node serves yet.

A model may be in the store before all its weights are on disk
(`shardmesh serve --model hf:REPO` fetches only what its span needs): its
`source` fetches a span's files before the span is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from consensus.placement import ModelFacts
from runtime.model.manifest import MANIFEST_FILE, ManifestError, load_manifest, manifest_digest

log = logging.getLogger("shardmesh.store")

DTYPE_BYTES: Final = {"F32": 4, "F16": 2, "BF16": 2}
STORED_RECIPE: Final = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}
"""A managed placement runs a model in the precision it is stored in: no
conversion error to budget for, and the doctor's goldens (fp32) check it
within that recipe's documented tolerance."""
RUNTIME_OVERHEAD_BYTES: Final = 64 * 1024 * 1024
"""Per shard, beyond its weights: the framework, KV caches of a few
sessions and activations. Generous for tiny models, modest for real ones
(whose embeddings dominate `overhead_bytes` anyway)."""


class WeightSource(Protocol):
    """Where a stored model's missing weight files come from
    (`runtime.model.hub.HubModel`)."""

    def fetch_span(self, start: int, end: int) -> list[str]:
        """Put the files shard [start, end) needs on disk (blocking); those
        files."""
        ...


@dataclass(frozen=True)
class StoredModel:
    name: str
    path: Path
    digest: str
    manifest: dict[str, Any]
    source: WeightSource | None = None
    """None: every weight file is on disk already."""


class ModelStore:
    """The models under one folder, by name: scanned at start, and a model
    added once its manifest is in place (`shardmesh serve`)."""

    def __init__(self, models: dict[str, StoredModel]) -> None:
        self.models = models

    @classmethod
    def scan(cls, root: Path | None, extra: Path | None = None) -> ModelStore:
        """Every model directory directly under `root`, plus `extra` (the
        node's pinned model). Unreadable ones are skipped with a warning: a
        half-copied model must not stop the node."""
        candidates = [] if root is None else sorted(p for p in root.iterdir() if p.is_dir())
        if extra is not None:
            candidates.append(extra)
        store = cls({})
        for path in candidates:
            if not (path / MANIFEST_FILE).exists():
                continue
            try:
                store.add(path)
            except ManifestError as exc:
                log.warning("model store: skipping %s: %s", path, exc)
        return store

    def add(self, path: Path, source: WeightSource | None = None) -> StoredModel:
        """Put the model at `path` (its manifest written) in the store,
        unless one of that name is there already; the stored entry.
        ManifestError if the manifest cannot be read."""
        manifest = load_manifest(path)
        name = manifest["name"]
        stored = StoredModel(name, path.resolve(), manifest_digest(manifest), manifest, source)
        return self.models.setdefault(name, stored)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.models))

    def get(self, name: str) -> StoredModel | None:
        return self.models.get(name)

    def by_digest(self, digest: str) -> Path | None:
        for model in self.models.values():
            if model.digest == digest:
                return model.path
        return None


def model_facts(manifest: dict[str, Any]) -> ModelFacts:
    """Placement's view of a model, from its manifest's tensor table: bytes
    of one layer (layer 0's tensors) and of the rest (embeddings, final
    norm, LM head), in the precision it is stored in."""
    tensors: dict[str, Any] = manifest["tensors"]
    layer = overhead = 0
    dtypes = set()
    for name, info in tensors.items():
        size = DTYPE_BYTES.get(info["dtype"], 4)
        for dim in info["shape"]:
            size *= int(dim)
        dtypes.add(info["dtype"])
        if name.startswith("model.layers.0."):
            layer += size
        elif not name.startswith("model.layers."):
            overhead += size
    stored = dtypes.pop() if len(dtypes) == 1 else "F32"
    return ModelFacts(
        num_layers=int(manifest["num_layers"]),
        layer_bytes=max(1, layer),
        overhead_bytes=overhead + RUNTIME_OVERHEAD_BYTES,
        recipe=STORED_RECIPE.get(stored, "fp32"),
    )
