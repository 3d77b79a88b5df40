"""Import a GGUF checkpoint as a model folder the swarm loads.

Pretrained models often reach machines as GGUF files (llama.cpp's format),
while every backend reads a Hugging Face folder. `import_gguf` converts one
with transformers' own GGUF reader (the `gguf` and `accelerate` packages,
in the `dev` extra), so the tensor-name mapping, rotary un-permuting and
tokenizer conversion are transformers' code, not a copy here. Quantized
tensors are dequantized to float32; the folder is written under a temporary
name and renamed when complete, so a crash never leaves one that looks
usable. More: docs/design/models.md#importing-a-gguf-checkpoint.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.model.backends import IMPORT_LOCK
from runtime.model.manifest import build_manifest
from runtime.model.progress import Progress
from runtime.model.weights import SINGLE_FILE

# Written by transformers' GGUF loader into the config to say "these weights
# came quantized"; the folder's weights are plain fp32, and transformers
# would refuse to read a safetensors folder whose config claims GGUF.
_GGUF_CONFIG_KEY = "quantization_config"
_LM_HEAD = "lm_head.weight"


def import_gguf(
    gguf_file: Path, out_dir: Path, name: str | None = None, progress: Progress | None = None
) -> Path:
    """Convert `gguf_file` into a model folder at `out_dir` (which must not
    exist) with fp32 safetensors, config, generation config, tokenizer files
    and a manifest built by `build_manifest` (goldens and calibration
    included); return `out_dir`. `name` is the manifest's model name
    (default: the folder's name). `progress` hears of each phase."""
    gguf_file = Path(gguf_file)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; import into a new folder")
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _convert(gguf_file, staging, out_dir.name if name is None else name, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(out_dir)
    return out_dir


def _convert(gguf_file: Path, out: Path, name: str, progress: Progress | None) -> None:
    """Write the model folder into the empty folder `out`."""
    with IMPORT_LOCK:  # transformers' lazy imports are not thread-safe
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

    with _gguf_read_once():
        _write_folder(gguf_file, out, name, progress)


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses the GGUF file anew for the config, the weights
    and the tokenizer, and builds gguf's tensor-name table anew for each of
    ~400 tensors: 40 of the 75 s a 135M model's conversion took here. Both
    are pure functions of their arguments (a file that does not change
    under us, an architecture and a layer count), so within one conversion
    each runs once. transformers looks both up on the `gguf` module when it
    calls them, which is where they are swapped."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    setattr(gguf, "GGUFReader", functools.cache(reader))  # noqa: B010 - a class, swapped
    setattr(gguf, "get_tensor_name_map", functools.cache(name_map))  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", reader)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", name_map)  # noqa: B010


def _write_folder(gguf_file: Path, out: Path, name: str, progress: Progress | None) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress.phase(f"reading {gguf_file.name} (transformers, dequantized to fp32)")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    config = model.config
    if hasattr(config, _GGUF_CONFIG_KEY):
        delattr(config, _GGUF_CONFIG_KEY)
    config.architectures = [type(model).__name__]
    if progress:
        progress.phase("writing config and fp32 safetensors")
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tensors = {
        tensor_name: tensor.detach().contiguous()
        for tensor_name, tensor in model.state_dict().items()
        # A tied head is the embedding matrix; the loaders read it from there.
        if not (tensor_name == _LM_HEAD and config.tie_word_embeddings)
    }
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    del model, tensors
    if progress:
        progress.phase("converting the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer.save_pretrained(out)
    build_manifest(out, name=name, progress=progress)
