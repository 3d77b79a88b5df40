"""`shardmesh serve`'s checks that need no swarm: whether a shard fits, and a peer's
manifest read defensively.

The whole of `shardmesh serve` (a founder and a joiner, the manifest from a
member) runs across processes in tests/processes/test_serve.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from mesh.records import BackendInfo
from runtime.model.manifest import manifest_digest
from runtime.model.store import ModelStore, StoredModel
from runtime.model.tiny import make_tiny_model
from runtime.node.options import NodeStartupError, Provision
from runtime.node.provision import Provisioner, _digest_or_none


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> StoredModel:
    folder = make_tiny_model(tmp_path_factory.mktemp("provision") / "tiny", layers=4, name="tiny")
    return ModelStore.scan(None).add(folder)


def provisioner(folder: Path, backend: str | None = "torch") -> Provisioner:
    unused = cast(Any, None)
    return Provisioner(
        Provision(folder),
        swarm=unused,
        joined=lambda: True,
        seeds=[],
        store=ModelStore.scan(None),
        slot=unused,
        placement=unused,
        assigned=lambda: False,
        republish=lambda: None,
        api=lambda: "http://127.0.0.1:1",
        backend=backend,
        max_memory=None,
    )


def test_a_node_without_the_backend_cannot_compute_a_shard(stored: StoredModel) -> None:
    with pytest.raises(NodeStartupError, match="backend torch is not installed"):
        provisioner(stored.path)._check_fits(stored, None)


def test_a_node_too_small_for_one_layer_says_what_a_layer_needs(stored: StoredModel) -> None:
    tiny = BackendInfo("torch", "cpu", 1)
    with pytest.raises(NodeStartupError, match="no gap of tiny fits this node: one layer needs"):
        provisioner(stored.path)._check_fits(stored, tiny)
    provisioner(stored.path)._check_fits(stored, BackendInfo("torch", "cpu", 2**34))  # fits


def test_a_peers_manifest_digest_or_none(stored: StoredModel) -> None:
    assert _digest_or_none(stored.manifest) == manifest_digest(stored.manifest) == stored.digest
    assert _digest_or_none({"not": "a manifest"}) is None
