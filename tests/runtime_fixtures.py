"""Tiny models shared by the runtime tests (session-scoped: built once).

Every test sees them: tests/conftest.py loads this module as a plugin.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.model.tiny import make_tiny_model

TINY_LAYERS = 8


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8-layer Qwen3, single-file safetensors, untied head, with manifest."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", layers=TINY_LAYERS)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8-layer Llama, index-sharded over 2 files, tied embeddings, with manifest."""
    return make_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-llama",
        layers=TINY_LAYERS,
        seed=1,
        family="llama",
        shards=2,
        tie_embeddings=True,
    )


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    """Each family in turn."""
    return request.getfixturevalue(f"{request.param}_dir")
