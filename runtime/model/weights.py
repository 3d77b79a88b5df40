"""Read only one shard's tensors out of a Hugging Face safetensors directory.

A node serving layers [a, b) of an L-layer model must not even *read* the
rest: a laptop may hold a 70B checkpoint on disk but not in memory. The
reader parses each file's JSON header and then reads exactly the byte ranges
of the tensors asked for (no mmap of the whole file), whole or a block of
rows at a time (`read_rows`); `bytes_read` counts what it read. Both
layouts Hugging Face writes are read: one `model.safetensors`, or an index
naming each tensor's file. Tensors come back as raw little-endian bytes plus
dtype and shape. More: docs/design/models.md#reading-one-shard.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model import architectures
from runtime.model.backends.base import BackendError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# Architectures whose tensor layout and layer classes the backends know
# (runtime/model/architectures.py says how they differ). Anything else
# would load but compute garbage, so it is refused by name.
SUPPORTED_ARCHITECTURES = tuple(architectures.FAMILIES)

# Bytes per element of the safetensors dtypes we may meet. Weights are F32,
# BF16 or F16; the integer types appear in quantized or auxiliary tensors and
# are listed so that a header mentioning them still parses.
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}

# The safetensors spec caps the JSON header at 100 MB; a larger claim means a
# corrupt or hostile file, and we refuse before allocating for it.
MAX_HEADER_BYTES = 100_000_000
HEADER_LENGTH_BYTES = 8


class ShardLoadError(BackendError):
    """A shard cannot be loaded from this model directory (missing or
    malformed file, missing tensor, wrong shape, bad span, unsupported
    architecture). The message names the file and tensor involved."""


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One tensor exactly as stored: safetensors dtype name, shape, bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def to_numpy(self) -> np.ndarray:
        """The tensor as a NumPy array; BF16, which NumPy lacks, is widened
        exactly to float32 (a bfloat16 is the top half of a float32)."""
        if self.dtype == "BF16":
            bits = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.shape)
        numpy_dtypes = {
            "F64": "<f8",
            "F32": "<f4",
            "F16": "<f2",
            "I64": "<i8",
            "I32": "<i4",
            "I16": "<i2",
            "I8": "i1",
            "U8": "u1",
            "BOOL": "?",
        }
        return np.frombuffer(self.data, dtype=numpy_dtypes[self.dtype]).reshape(self.shape)


@dataclass(frozen=True, slots=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a supported architecture, with the family's defaults
    for keys it leaves out (`architectures.Family.defaults`), or a
    ShardLoadError saying what is wrong with it."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardLoadError(f"{path}: no config.json, not a model directory") from None
    except (OSError, ValueError) as exc:
        raise ShardLoadError(f"{path}: unreadable config: {exc}") from exc
    named = config.get("architectures") or []
    if not any(arch in SUPPORTED_ARCHITECTURES for arch in named):
        raise ShardLoadError(
            f"{path}: unsupported architecture {named or '(none)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"):
        if not isinstance(config.get(key), int):
            raise ShardLoadError(f"{path}: config lacks integer {key!r}")
    config = {**architectures.family(config).defaults, **config}
    try:
        architectures.layer_kinds(config)
    except ValueError as exc:
        raise ShardLoadError(f"{path}: {exc}") from None
    return config


def architecture(config: dict[str, Any]) -> str:
    """The supported architecture named by a config read with read_config."""
    return architectures.family(config).architecture


def head_dim(config: dict[str, Any]) -> int:
    """Per-head width: explicit in Qwen3 configs, derived in older Llama ones."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def check_span(config: dict[str, Any], start: int, end: int) -> None:
    """Refuse an empty or out-of-range layer span [start, end)."""
    layers = config["num_hidden_layers"]
    if not 0 <= start < end <= layers:
        raise ShardLoadError(
            f"layer span [{start}, {end}) is not a non-empty part of the model's "
            f"{layers} layers [0, {layers})"
        )


def expected_shapes(config: dict[str, Any], start: int, end: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the shard [start, end) needs, with the shape the config
    implies, in the layout of the family's checkpoints (see
    architectures.Family). The first shard owns the embeddings; the last
    owns the final norm and the LM head, which with tied embeddings *is*
    the embedding matrix (so the last shard then reads
    `model.embed_tokens.weight`)."""
    check_span(config, start, end)
    hidden = config["hidden_size"]
    vocab = config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    if start == 0:
        shapes["model.embed_tokens.weight"] = (vocab, hidden)
    for i in range(start, end):
        shapes.update(_layer_shapes(config, i))
    if end == config["num_hidden_layers"]:
        shapes["model.norm.weight"] = (hidden,)
        tied = bool(config.get("tie_word_embeddings"))
        shapes["model.embed_tokens.weight" if tied else "lm_head.weight"] = (vocab, hidden)
    return shapes


def _layer_shapes(config: dict[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer `layer`, named as in the checkpoint."""
    family = architectures.family(config)
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    dim = head_dim(config)
    attention_bias = family.config_biases and bool(config.get("attention_bias"))
    mlp_bias = family.config_biases and bool(config.get("mlp_bias"))

    p = f"model.layers.{layer}."
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family.feedforward_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    shapes: dict[str, tuple[int, ...]] = {f"{p}{norm}.weight": (hidden,) for norm in norms}

    attention: dict[str, tuple[int, ...]] = {"o_proj": (hidden, heads * dim)}
    if family.fused_projections:
        attention["qkv_proj"] = ((heads + 2 * kv_heads) * dim, hidden)
    else:
        attention["q_proj"] = (heads * dim, hidden)
        attention["k_proj"] = (kv_heads * dim, hidden)
        attention["v_proj"] = (kv_heads * dim, hidden)
    for name, shape in attention.items():
        shapes[f"{p}self_attn.{name}.weight"] = shape
        if attention_bias or (family.qkv_bias and name != "o_proj"):
            shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
    if family.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (dim,)
        shapes[p + "self_attn.k_norm.weight"] = (dim,)

    if architectures.is_sparse_layer(config, layer):
        experts = architectures.num_experts(config)
        width = config["moe_intermediate_size"]
        shapes[p + "mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", hidden, width, bias=False))
    elif family.fused_projections:
        inter = config["intermediate_size"]
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    else:
        shapes.update(_mlp_shapes(p + "mlp.", hidden, config["intermediate_size"], mlp_bias))
    return shapes


def _mlp_shapes(prefix: str, hidden: int, width: int, bias: bool) -> dict[str, tuple[int, ...]]:
    """A gated MLP's three projections (and biases) under `prefix`."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in {
        "gate_proj": (width, hidden),
        "up_proj": (width, hidden),
        "down_proj": (hidden, width),
    }.items():
        shapes[f"{prefix}{name}.weight"] = shape
        if bias:
            shapes[f"{prefix}{name}.bias"] = (shape[0],)
    return shapes


def tensor_names_for_shard(config: dict[str, Any], start: int, end: int) -> list[str]:
    """Hugging Face tensor names the shard [start, end) needs, in load order."""
    return list(expected_shapes(config, start, end))


class SafetensorsReader:
    """Reads chosen tensors from a model directory by byte range.

    Opening parses only the headers (a few KB per file). `read` then seeks to
    each requested tensor and reads its bytes; `bytes_read` is the running
    total of tensor bytes read, `total_bytes` the size of all tensors listed.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.bytes_read = 0
        self._entries: dict[str, _Entry] = {}
        index = self.model_dir / INDEX_FILE
        single = self.model_dir / SINGLE_FILE
        if index.exists():
            self._open_index(index)
        elif single.exists():
            self._entries.update(_parse_file(single))
        else:
            raise ShardLoadError(f"{self.model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")

    def _open_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ShardLoadError(f"{index}: unreadable safetensors index: {exc}") from exc
        files = sorted(set(weight_map.values()))
        for file_name in files:
            path = self.model_dir / file_name
            if path.parent != self.model_dir:
                raise ShardLoadError(f"{index}: file {file_name!r} is outside the model directory")
            entries = _parse_file(path)
            for name, file_of in weight_map.items():
                if file_of != file_name:
                    continue
                if name not in entries:
                    raise ShardLoadError(
                        f"{path}: tensor {name!r} is listed in {INDEX_FILE} but not in the file"
                    )
                self._entries[name] = entries[name]

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data in the whole checkpoint."""
        return sum(e.end - e.begin for e in self._entries.values())

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint, sorted."""
        return sorted(self._entries)

    def file_of(self, name: str) -> Path:
        """The file that holds tensor `name`."""
        return self._lookup(name).file

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name` (read from the header only)."""
        return self._lookup(name).shape

    def byte_range(self, name: str) -> tuple[Path, int, int]:
        """(file, first byte, end byte) of tensor `name`'s data in its file:
        what the doctor sizes memory by, and what tests corrupt."""
        entry = self._lookup(name)
        return entry.file, entry.begin, entry.end

    def _lookup(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            where = INDEX_FILE if (self.model_dir / INDEX_FILE).exists() else SINGLE_FILE
            raise ShardLoadError(f"{self.model_dir / where}: missing tensor {name!r}") from None

    def read_rows(self, name: str, start: int, stop: int) -> RawTensor:
        """Rows [start, stop) of tensor `name` along its first dimension
        (a tensor is stored row-major, so they are one contiguous byte
        range): what a loader reads to convert a large tensor block by
        block."""
        entry = self._lookup(name)
        rows = entry.shape[0] if entry.shape else 0
        if not 0 <= start < stop <= rows:
            raise ShardLoadError(
                f"{entry.file}: rows [{start}, {stop}) are outside tensor {name!r} of {rows} rows"
            )
        row_bytes = (entry.end - entry.begin) // rows
        begin = entry.begin + start * row_bytes
        size = (stop - start) * row_bytes
        with entry.file.open("rb", buffering=0) as f:
            f.seek(begin)
            data = f.read(size)
        if len(data) != size:
            raise ShardLoadError(
                f"{entry.file}: truncated: tensor {name!r} needs {size} bytes "
                f"at offset {begin}, file gave {len(data)}"
            )
        self.bytes_read += size
        return RawTensor(entry.dtype, (stop - start, *entry.shape[1:]), data)

    def read(self, names: list[str]) -> dict[str, RawTensor]:
        """The named tensors, reading only their byte ranges (file by file, in
        offset order, so the disk sees forward seeks)."""
        entries = {name: self._lookup(name) for name in names}
        out: dict[str, RawTensor] = {}
        by_file: dict[Path, list[tuple[str, _Entry]]] = {}
        for name, entry in entries.items():
            by_file.setdefault(entry.file, []).append((name, entry))
        for path, items in by_file.items():
            items.sort(key=lambda item: item[1].begin)
            with path.open("rb", buffering=0) as f:
                for name, entry in items:
                    f.seek(entry.begin)
                    size = entry.end - entry.begin
                    data = f.read(size)
                    if len(data) != size:
                        raise ShardLoadError(
                            f"{path}: truncated: tensor {name!r} needs {size} bytes "
                            f"at offset {entry.begin}, file gave {len(data)}"
                        )
                    self.bytes_read += size
                    out[name] = RawTensor(entry.dtype, entry.shape, data)
        return {name: out[name] for name in names}


def shard_shapes(
    model_dir: Path, start: int, end: int, reader: SafetensorsReader
) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Config and the tensors shard [start, end) needs with their shapes,
    each checked against `reader`'s headers before any data is read, so a
    mismatched checkpoint is refused before memory is spent on it."""
    config = read_config(model_dir)
    shapes = expected_shapes(config, start, end)
    for name, shape in shapes.items():
        stored = reader.shape_of(name)
        if stored != shape:
            raise ShardLoadError(
                f"{reader.file_of(name)}: tensor {name!r} has shape {list(stored)}, "
                f"config.json implies {list(shape)}"
            )
    return config, shapes


def read_shard_tensors(
    model_dir: Path, start: int, end: int, reader: SafetensorsReader | None = None
) -> tuple[dict[str, Any], dict[str, RawTensor]]:
    """Config and the tensors of shard [start, end), each checked against the
    shape the config implies. Pass a `reader` to watch its `bytes_read`."""
    reader = reader or SafetensorsReader(model_dir)
    config, shapes = shard_shapes(model_dir, start, end, reader)
    return config, reader.read(list(shapes))


def read_tensors(model_dir: Path, names: list[str]) -> dict[str, RawTensor]:
    """The named tensors from a model directory (no shape checks)."""
    return SafetensorsReader(model_dir).read(names)


def _parse_file(path: Path) -> dict[str, _Entry]:
    """The header of one .safetensors file, validated against the file size so
    that a truncated download is reported on open, not mid-forward."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(HEADER_LENGTH_BYTES)
            if len(prefix) != HEADER_LENGTH_BYTES:
                raise ShardLoadError(f"{path}: truncated: no safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + header_len > size:
                raise ShardLoadError(
                    f"{path}: truncated or corrupt: header claims {header_len} bytes, "
                    f"file has {size}"
                )
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise ShardLoadError(f"{path}: file not found") from None
    except (OSError, ValueError) as exc:
        raise ShardLoadError(f"{path}: unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ShardLoadError(f"{path}: safetensors header is not a JSON object")

    data_start = HEADER_LENGTH_BYTES + header_len
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardLoadError(f"{path}: bad header entry for {name!r}: {exc}") from exc
        if dtype not in DTYPE_SIZES:
            raise ShardLoadError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != numel * DTYPE_SIZES[dtype] or begin < 0:
            raise ShardLoadError(
                f"{path}: tensor {name!r}: byte range [{begin}, {end}) does not fit "
                f"{dtype}{list(shape)}"
            )
        if data_start + end > size:
            raise ShardLoadError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, "
                f"file has {size}"
            )
        entries[name] = _Entry(path, dtype, shape, data_start + begin, data_start + end)
    return entries
