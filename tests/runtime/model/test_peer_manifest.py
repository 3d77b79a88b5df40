"""Whether a member's manifest describes a local folder
(`runtime.model.peer_manifest.manifest_mismatch`): every way it can fail to,
each said in one line that names at most a few tensors or files. `shardmesh
serve` taking such a manifest is in tests/runtime/cli/commands/test_serve.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from runtime.model.manifest import load_manifest, tensor_table
from runtime.model.peer_manifest import MAX_NAMED, manifest_mismatch


@pytest.fixture
def built(qwen3_dir: Path) -> Path:
    """The member's copy: the session's tiny model with its manifest."""
    return qwen3_dir


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> Path:
    """The same model without a manifest: a volunteer's copy."""
    return Path(
        shutil.copytree(built, tmp_path / "mine", ignore=shutil.ignore_patterns("shardmesh-*"))
    )


def clone(manifest: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(manifest))
    return copied


def test_many_differing_tensors_are_named_a_few_and_counted(built: Path, copy: Path) -> None:
    manifest = load_manifest(built)
    table = tensor_table(copy)
    forged = clone(manifest)
    names = sorted(forged["tensors"])
    for name in names:
        forged["tensors"][name]["sha256"] = "0" * 64
    reason = manifest_mismatch(forged, copy, table)
    assert reason is not None
    assert reason.startswith("tensors differ from this folder's: " + ", ".join(names[:MAX_NAMED]))
    assert reason.endswith(f" and {len(names) - MAX_NAMED} more")


def test_names_only_still_catches_a_different_tensor_list(built: Path, copy: Path) -> None:
    manifest = load_manifest(built)
    names = sorted(manifest["tensors"])
    assert manifest_mismatch(manifest, copy, names) is None
    assert manifest_mismatch(manifest, copy, [*names, "extra.weight"]) == (
        "it lists other tensors than this checkpoint's (not listed: extra.weight; not here: none)"
    )
    # With names only, a tensor's digest is not compared (the doctor checks
    # a span's digests when it loads it).
    forged = clone(manifest)
    forged["tensors"][names[0]]["sha256"] = "0" * 64
    assert manifest_mismatch(forged, copy, names) is None


def test_a_tokenizer_file_the_folder_lacks_or_has_extra_is_named(built: Path, copy: Path) -> None:
    manifest = load_manifest(built)
    table = tensor_table(copy)
    extra = clone(manifest)
    extra["tokenizer_files"]["added_tokens.json"] = "0" * 64
    assert manifest_mismatch(extra, copy, table) == "tokenizer files differ: added_tokens.json"
    not_a_table = {**manifest, "tokenizer_files": ["tokenizer.json"]}
    assert manifest_mismatch(not_a_table, copy, table) is not None


def test_a_manifest_that_is_not_one_says_so(copy: Path) -> None:
    table = tensor_table(copy)
    for junk in (None, [], "manifest", {"name": "tiny"}):
        reason = manifest_mismatch(junk, copy, table)
        assert isinstance(reason, str) and reason
