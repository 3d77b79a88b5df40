"""Compute backends and the choice between them.

`load_shard` picks MLX on Apple silicon (Metal, unified memory) and torch
everywhere else, unless told otherwise. Backend modules are imported only
here, lazily, so a node without torch (a Mac running MLX) or without MLX
(a Linux GPU box) imports the rest of shardmesh fine and gets a clear
"not installed" error only when it asks for the missing backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
import threading

from runtime.model.backends.base import BackendError, ShardBackend, ShardSpec

BACKENDS = ("torch", "mlx")

# What to install for each backend (the extras in pyproject.toml).
_INSTALL_HINT = {
    "torch": "pip install 'shardmesh[runtime,torch]'",
    "mlx": "pip install 'shardmesh[runtime,mlx]'",
}
REQUIRED_MODULES = {"torch": ("torch", "transformers"), "mlx": ("mlx.core", "mlx_lm")}
"""What each backend imports to load a shard (the doctor imports them to check)."""


IMPORT_LOCK = threading.RLock()
"""Held while importing backend libraries or resolving transformers' lazy
attributes. transformers' lazy module is not safe to resolve from two
threads at once: a node importing torch for its capacity probe while its
chat entry loads a tokenizer saw `ImportError: cannot import name
'AutoTokenizer'` from a half-built module. Everything that may be first to
touch these libraries takes this lock."""


def import_libraries(*modules: str) -> None:
    """Import `modules` under IMPORT_LOCK (cheap once they are loaded)."""
    with IMPORT_LOCK:
        for module in modules:
            importlib.import_module(module)


def default_backend() -> str:
    """MLX on Apple silicon, torch elsewhere."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mlx"
    return "torch"


def backend_available(name: str) -> bool:
    """Whether the packages backend `name` needs are importable here."""
    return all(_findable(m) for m in REQUIRED_MODULES[name])


def _findable(module: str) -> bool:
    # find_spec of a submodule imports its parent, which may itself fail.
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def load_shard(spec: ShardSpec, backend: str | None = None) -> ShardBackend:
    """Load shard `spec` on `backend` (default: default_backend()).

    Raises BackendError when the backend is unknown or not installed, and
    whatever the backend raises (a BackendError subclass) when the shard,
    recipe or device is wrong."""
    name = backend or default_backend()
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if not backend_available(name):
        raise BackendError(f"backend {name} is not installed: {_INSTALL_HINT[name]}")
    import_libraries(*REQUIRED_MODULES[name], f"runtime.model.backends.{name}_backend")
    if name == "torch":
        from runtime.model.backends.torch_backend import load_torch_shard

        return load_torch_shard(spec)
    from runtime.model.backends.mlx_backend import load_mlx_shard

    return load_mlx_shard(spec)
