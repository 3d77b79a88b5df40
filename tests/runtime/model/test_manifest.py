"""Manifests: identity digests and golden activations that agree with what
the shards compute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from runtime.model.backends.base import ShardSpec
from runtime.model.backends.torch_backend import load_torch_shard
from runtime.model.manifest import (
    GOLDEN_FILE,
    MANIFEST_FILE,
    PROBE_LENGTH,
    ManifestError,
    build_manifest,
    load_golden,
    load_manifest,
    manifest_digest,
    probe_token_ids,
)
from runtime.model.weights import SafetensorsReader, read_config

# Goldens are computed one layer at a time; chained multi-layer shards run
# the same kernels on the same inputs, so they agree to float32 rounding.
GOLDEN_ATOL = 1e-5


def test_manifest_contents(model_dir: Path) -> None:
    manifest = load_manifest(model_dir)
    config = read_config(model_dir)
    assert manifest["name"] == model_dir.name
    assert manifest["architecture"] == config["architectures"][0]
    assert manifest["num_layers"] == 8 and manifest["hidden_size"] == 64
    assert sorted(manifest["tensors"]) == SafetensorsReader(model_dir).names()
    assert all(len(t["sha256"]) == 64 for t in manifest["tensors"].values())
    assert "tokenizer.json" in manifest["tokenizer_files"]
    assert manifest["probe"]["token_ids"] == probe_token_ids(config["vocab_size"])
    assert manifest["golden"]["boundaries"] == 9


def test_probe_is_fixed_and_in_range() -> None:
    ids = probe_token_ids(300)
    assert ids == probe_token_ids(300) and len(ids) == PROBE_LENGTH
    assert all(0 <= i < 300 for i in ids) and len(set(ids)) > 1


def test_golden_matches_chained_shards(model_dir: Path) -> None:
    manifest = load_manifest(model_dir)
    golden = load_golden(model_dir, manifest)
    ids = np.asarray(manifest["probe"]["token_ids"])
    positions = np.arange(len(ids))
    assert len(golden.boundaries) == 9
    assert all(b.shape == (len(ids), 64) and b.dtype == np.float32 for b in golden.boundaries)
    embed = SafetensorsReader(model_dir).read(["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        golden.boundaries[0], embed["model.embed_tokens.weight"].to_numpy()[ids]
    )
    hidden: np.ndarray = ids
    for start, end in [(0, 3), (3, 6), (6, 8)]:
        shard = load_torch_shard(ShardSpec(model_dir, start, end, "fp32"), "cpu")
        cache = shard.new_cache()
        if shard.is_last:
            last = shard.forward(hidden, positions, cache, apply_head=False)
            np.testing.assert_allclose(last, golden.boundaries[end], rtol=0, atol=GOLDEN_ATOL)
            hidden = shard.head(last)
            np.testing.assert_allclose(hidden, golden.logits, rtol=0, atol=GOLDEN_ATOL)
        else:
            hidden = shard.forward(hidden, positions, cache)
            np.testing.assert_allclose(hidden, golden.boundaries[end], rtol=0, atol=GOLDEN_ATOL)


def test_digest_is_stable_and_covers_the_model(qwen3_dir: Path, tmp_path: Path) -> None:
    original = load_manifest(qwen3_dir)
    model = Path(shutil.copytree(qwen3_dir, tmp_path / "copy"))
    rebuilt = build_manifest(model)
    assert rebuilt["name"] == "tiny-qwen3"  # a rebuild keeps the name
    assert manifest_digest(rebuilt) == manifest_digest(original)
    assert manifest_digest(build_manifest(model, name="other")) != manifest_digest(original)

    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (model / "config.json").write_text(json.dumps(config))
    changed = build_manifest(model, name="tiny-qwen3")
    assert changed["config_sha256"] != original["config_sha256"]
    assert manifest_digest(changed) != manifest_digest(original)


def test_digest_ignores_golden_bits(qwen3_dir: Path) -> None:
    manifest = load_manifest(qwen3_dir)
    other = json.loads(json.dumps(manifest))
    other["golden"]["sha256"] = "0" * 64  # goldens computed on another CPU
    assert manifest_digest(other) == manifest_digest(manifest)
    other["tensors"]["model.norm.weight"]["sha256"] = "0" * 64
    assert manifest_digest(other) != manifest_digest(manifest)


def test_load_errors(qwen3_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no manifest; run `shardmesh manifest build"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ManifestError, match="unreadable manifest"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(ManifestError, match="expected 'shardmesh-manifest/1'"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": "shardmesh-manifest/1"}))
    with pytest.raises(ManifestError, match="lacks name, architecture"):
        load_manifest(tmp_path)

    model = Path(shutil.copytree(qwen3_dir, tmp_path / "copy"))
    manifest = load_manifest(model)
    golden = model / GOLDEN_FILE
    data = bytearray(golden.read_bytes())
    data[-1] ^= 0x01
    golden.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="do not match the manifest's digest"):
        load_golden(model, manifest)
    golden.unlink()
    with pytest.raises(ManifestError, match="golden activations file is missing"):
        load_golden(model, manifest)
