"""A node's local model store (`runtime.model.store`): which folders it
finds, which it skips, and what placement learns of a model from its
manifest alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from runtime.model.manifest import MANIFEST_FILE, load_manifest, manifest_digest
from runtime.model.store import (
    RUNTIME_OVERHEAD_BYTES,
    ModelStore,
    model_facts,
)


def write_manifest(folder: Path, manifest: dict[str, Any], name: str) -> Path:
    """A store entry: only its manifest, renamed (nothing else is read)."""
    folder.mkdir(parents=True)
    (folder / MANIFEST_FILE).write_text(json.dumps({**manifest, "name": name}))
    return folder


@pytest.fixture
def manifest(qwen3_dir: Path) -> dict[str, Any]:
    return load_manifest(qwen3_dir)


def test_a_scan_finds_every_model_folder_and_skips_the_rest(
    tmp_path: Path, manifest: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    write_manifest(root / "b", manifest, "model-b")
    write_manifest(root / "a", manifest, "model-a")
    (root / "not-a-model").mkdir()  # no manifest: not a model, not a warning
    (root / "half-copied").mkdir()
    (root / "half-copied" / MANIFEST_FILE).write_text("{")
    (root / "stray.txt").write_text("x")
    pinned = write_manifest(tmp_path / "elsewhere", manifest, "pinned")
    with caplog.at_level(logging.WARNING, logger="shardmesh.store"):
        store = ModelStore.scan(root, extra=pinned)
    assert store.names() == ("model-a", "model-b", "pinned")
    assert [r.getMessage() for r in caplog.records if "half-copied" in r.getMessage()]
    stored = store.get("model-a")
    assert stored is not None
    assert stored.path == (root / "a").resolve()
    assert stored.digest == manifest_digest(load_manifest(root / "a"))
    assert stored.source is None
    assert store.get("absent") is None
    assert ModelStore.scan(None).names() == ()
    assert ModelStore.scan(None, extra=pinned).names() == ("pinned",)


def test_the_first_model_of_a_name_stays_and_digests_find_folders(
    tmp_path: Path, manifest: dict[str, Any]
) -> None:
    store = ModelStore({})
    first = store.add(write_manifest(tmp_path / "one", manifest, "same"))
    again = store.add(write_manifest(tmp_path / "two", manifest, "same"))
    assert again is first and first.path == (tmp_path / "one").resolve()
    assert store.by_digest(first.digest) == first.path
    assert store.by_digest("0" * 64) is None


def test_model_facts_size_one_layer_and_the_rest_in_the_stored_precision() -> None:
    def tensor(dtype: str, *shape: int) -> dict[str, Any]:
        return {"dtype": dtype, "shape": list(shape), "sha256": "0" * 64}

    manifest = {
        "num_layers": 2,
        "tensors": {
            "model.embed_tokens.weight": tensor("BF16", 100, 8),
            "model.layers.0.mlp.up_proj.weight": tensor("BF16", 16, 8),
            "model.layers.0.input_layernorm.weight": tensor("BF16", 8),
            "model.layers.1.mlp.up_proj.weight": tensor("BF16", 16, 8),
            "model.norm.weight": tensor("BF16", 8),
        },
    }
    facts = model_facts(manifest)
    assert facts.num_layers == 2
    assert facts.layer_bytes == (16 * 8 + 8) * 2
    assert facts.overhead_bytes == (100 * 8 + 8) * 2 + RUNTIME_OVERHEAD_BYTES
    assert facts.recipe == "bf16"
    mixed = {**manifest, "tensors": {**manifest["tensors"], "lm_head.weight": tensor("F32", 4)}}
    assert model_facts(mixed).recipe == "fp32"  # mixed precisions: run in fp32
    no_layers = {"num_layers": 1, "tensors": {"model.norm.weight": tensor("F16", 8)}}
    assert model_facts(no_layers).layer_bytes == 1  # never 0: placement divides by it
    assert model_facts(no_layers).recipe == "fp16"
