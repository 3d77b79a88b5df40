"""The torch backend: a span of transformers decoder layers on CUDA, MPS or CPU.

Only the shard's modules are built (on the meta device) and given exactly
the shard's tensors (`runtime.model.weights`), read a block of rows at a
time and converted or quantized straight into the shard's storage, so
memory is the shard's in its recipe. The layers are transformers' own
classes, reached only through `torch_adapter`; the family's embedding
scale, masks, rotary pairs and softcap come from
`runtime/model/architectures.py`. q8/q4 use MLX's affine group grid: on CPU
through torch's int4 weight-only kernel (q8 as two 4-bit planes), elsewhere
dequantized inside each matmul; the token embedding at 8 bits under both.

Why this kernel, what it costs in accuracy and speed, and why an 8-bit
embedding: docs/design/recipes.md#q8-and-q4-on-torch.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.model import architectures
from runtime.model.backends import batching
from runtime.model.backends import torch_adapter as adapter
from runtime.model.backends.base import BackendError, KVCache, ShardPosition, ShardSpec
from runtime.model.backends.batching import Step
from runtime.model.recipes import QUANT_GROUP_SIZE, Recipe, check_recipe
from runtime.model.weights import RawTensor, SafetensorsReader, architecture, shard_shapes

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_RAW_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# Tensor-name prefixes of each module a shard may own.
_EMBED = "model.embed_tokens.weight"
_NORM = "model.norm.weight"
_LM_HEAD = "lm_head.weight"

# The int4 kernel's digits: 4 bits each, read as signed by subtracting 8.
_PLANE_BITS = 4
_PLANE_OFFSET = 8
# The kernel computes output rows in blocks of 16, 32, 48 or 64.
_KERNEL_ROW_MULTIPLE = 16
# The kernel's packing interleaves rows in blocks of 64 (AVX-512) or 32
# (AVX2, other CPUs), independently per block, so a block of rows whose size
# is a multiple of 64 packs into exactly its slice of the whole weight's
# packing; loading packs row blocks of that size one at a time.
_PACK_ROW_BLOCK = 64
# The packing function's `innerKTiles` argument: a CUDA layout parameter
# that the CPU packing ignores (torchao passes 1 too).
_CPU_INNER_K_TILES = 1
# The activations' dtype inside the kernel: the one it is vectorized for.
_KERNEL_DTYPE = torch.bfloat16
# float32 bytes of a tensor converted or quantized at a time while loading:
# hundreds of rows of a real model (2.3 KB per 576-wide row). Small because
# the allocator keeps freed blocks of a few MB for reuse rather than
# returning them: loading SmolLM2-135M in q8 peaked 110 MB above its
# weights with 8 MiB blocks, 25-35 MB with 1 MiB ones. Per block the work
# is ~20 tensor ops, a fraction of a second per 100M weights in all.
_LOAD_BLOCK_BYTES = 1 << 20
# Bits of a quantized recipe's token embedding (why 8 under q4 too:
# docs/design/recipes.md#q8-and-q4-on-torch).
_EMBEDDING_BITS = 8
# The smallest positive normal bfloat16: the scale of a constant group,
# whose weights are then all exactly its bias.
_BF16_TINY = torch.finfo(torch.bfloat16).tiny


def default_device() -> str:
    """The best device here: CUDA, then Apple's MPS, then the CPU."""
    if torch.cuda.is_available():
        return "cuda:0"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


@dataclass(frozen=True, slots=True)
class AffineGrid:
    """A block of rows quantized onto the affine group grid: for rows r and
    group g, weight ~ codes * scale[r, g] + bias[r, g]. `zeros` are the
    kernel's per-plane zero points (high plane first), bfloat16 values whose
    sum minus the planes' offsets is `bias` exactly, so the kernel and the
    plain dequantization compute the very same weights."""

    codes: torch.Tensor  # uint8 [rows, in]
    scale: torch.Tensor  # float32 [rows, groups], bfloat16-exact values
    bias: torch.Tensor  # float32 [rows, groups]
    zeros: torch.Tensor  # bfloat16 [planes, rows, groups]


def quantize_rows(weight: torch.Tensor, bits: int) -> AffineGrid:
    """`weight` [rows, in] on the `bits`-bit affine grid of groups of
    QUANT_GROUP_SIZE along `in` (as MLX: scale = range / (2^bits - 1), codes
    rounded to nearest). Scales are rounded *up* to bfloat16, so a group's
    largest weight never falls off the top code; the bias is the group
    minimum carried in one bfloat16 zero per plane (q8's second plane takes
    the first's rounding remainder, so its bias is exact to ~2^-16 of the
    group's offset), then the codes are rounded against exactly that scale
    and bias. Each weight is therefore within half a step (plus q4's one
    bfloat16 rounding of its group's centre) of its value."""
    rows, width = weight.shape
    planes = bits // _PLANE_BITS
    levels = (1 << bits) - 1
    groups = weight.float().reshape(rows, width // QUANT_GROUP_SIZE, QUANT_GROUP_SIZE)
    low, high = torch.aminmax(groups, dim=-1)
    scale = _bf16_at_least(((high - low) / levels).clamp_min(_BF16_TINY))
    # Plane p adds (d_p - 8) * 16^p * scale + zero_p, so the planes' zeros
    # must sum to the bias plus the digits' offsets, 8 * scale * sum(16^p).
    offsets = _PLANE_OFFSET * scale * _place_values(planes)
    remaining = low + offsets
    zeros = []
    for plane in reversed(range(planes)):
        lower_offsets = _PLANE_OFFSET * scale * _place_values(plane)
        zero = (remaining - lower_offsets).to(torch.bfloat16)
        zeros.append(zero)
        remaining = remaining - zero.float()
    bias = torch.stack(zeros).float().sum(dim=0) - offsets
    codes = groups.sub(bias[..., None]).div_(scale[..., None]).round_().clamp_(0, levels)
    return AffineGrid(codes.to(torch.uint8).reshape(rows, width), scale, bias, torch.stack(zeros))


def _place_values(planes: int) -> int:
    """16^0 + ... + 16^(planes-1): a code's value per unit of every digit."""
    return ((1 << (_PLANE_BITS * planes)) - 1) // ((1 << _PLANE_BITS) - 1)


def _bf16_at_least(values: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= each (positive) value, as float32."""
    nearest = values.to(torch.bfloat16)
    # For positive floats the next representable value up is the next bit pattern.
    above = (nearest.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(nearest.float() < values, above, nearest).float()


class PlainAffine(nn.Module):
    """Affine-quantized rows kept plainly: codes (two to a byte at 4 bits),
    float32 scale and bias per group. Rows are dequantized on demand, which
    is what an embedding lookup needs and what a matmul on a device without
    the int4 kernel falls back to."""

    # Buffers (register_buffer below), declared so the type checker sees
    # tensors rather than nn.Module.__getattr__'s `Tensor | Module`.
    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor

    def __init__(self, rows: int, width: int, bits: int, device: torch.device) -> None:
        super().__init__()
        self.bits = bits
        self.width = width
        groups = width // QUANT_GROUP_SIZE
        # Not persistent: they are no checkpoint format, and so stay out of
        # strict state-dict loading of the modules that hold them.
        self.register_buffer(
            "codes", torch.empty(rows, width * bits // 8, dtype=torch.uint8, device=device), False
        )
        self.register_buffer("scale", torch.empty(rows, groups, device=device), False)
        self.register_buffer("bias", torch.empty(rows, groups, device=device), False)

    def fill(self, first_row: int, grid: AffineGrid) -> None:
        """Store a block of quantized rows starting at `first_row`."""
        codes = grid.codes
        if self.bits == _PLANE_BITS:
            codes = codes[:, 0::2] | (codes[:, 1::2] << _PLANE_BITS)
        stop = first_row + len(codes)
        self.codes[first_row:stop] = codes
        self.scale[first_row:stop] = grid.scale
        self.bias[first_row:stop] = grid.bias

    def dequantize(self, rows: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """The weights of `rows` (indices or a slice), [n, width] in `dtype`."""
        codes = self.codes[rows]
        if self.bits == _PLANE_BITS:
            low_mask = (1 << _PLANE_BITS) - 1
            codes = torch.stack([codes & low_mask, codes >> _PLANE_BITS], dim=-1)
        groups = codes.reshape(len(codes), -1, QUANT_GROUP_SIZE).float()
        weights = groups * self.scale[rows][..., None] + self.bias[rows][..., None]
        return weights.reshape(len(codes), self.width).to(dtype)


class QuantizedEmbedding(PlainAffine):
    """A token embedding on the affine grid; a lookup dequantizes its rows."""

    def __init__(
        self, rows: int, width: int, bits: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__(rows, width, bits, device)
        self.out_dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize(ids.reshape(-1), self.out_dtype).reshape(*ids.shape, self.width)


class DequantizingLinear(PlainAffine):
    """A linear layer on the affine grid for devices without the int4
    kernel: the whole weight is dequantized for each matmul. A projection's
    bias (Qwen2's q/k/v) stays in float, `output_bias`."""

    output_bias: torch.Tensor | None

    def __init__(self, rows: int, width: int, bits: int, device: torch.device) -> None:
        super().__init__(rows, width, bits, device)
        self.register_buffer("output_bias", None, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(
            x, self.dequantize(slice(None), x.dtype), _bias_for(self.output_bias, x.dtype)
        )


class Int4KernelLinear(nn.Module):
    """A linear layer on the affine grid, computed by torch's CPU int4
    kernel (docs/design/recipes.md#q8-and-q4-on-torch): `bits` / 4 planes
    of digits in the kernel's packing, with a bfloat16 scale and zero per
    plane and group.
    A projection's bias stays in float (`output_bias`) and is added to the
    kernel's output in the activations' dtype."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    output_bias: torch.Tensor | None

    def __init__(self, rows: int, width: int, bits: int) -> None:
        super().__init__()
        self.planes = bits // _PLANE_BITS
        self.rows = rows
        groups = width // QUANT_GROUP_SIZE
        packed_width = self.planes * width * _PLANE_BITS // 8
        self.register_buffer("packed", torch.empty(rows, packed_width, dtype=torch.uint8), False)
        self.register_buffer(
            "scale_zeros",
            torch.empty(self.planes * groups, rows, 2, dtype=_KERNEL_DTYPE),
            False,
        )
        self.register_buffer("output_bias", None, False)

    def fill(self, first_row: int, grid: AffineGrid) -> None:
        """Pack a block of quantized rows starting at `first_row`, which (like
        the block's length, unless it is the last) is a multiple of
        _PACK_ROW_BLOCK so that its packing is its slice of the whole."""
        digit_mask = (1 << _PLANE_BITS) - 1
        high_first = list(reversed(range(self.planes)))
        digits = [(grid.codes >> (_PLANE_BITS * p)) & digit_mask for p in high_first]
        stop = first_row + len(grid.codes)
        self.packed[first_row:stop] = torch._convert_weight_to_int4pack_for_cpu(
            torch.cat(digits, dim=1).to(torch.int32), _CPU_INNER_K_TILES
        )
        # Scales of 16^p * scale are exact in bfloat16 (scale is bfloat16).
        scales = [(grid.scale * (1 << (_PLANE_BITS * p))).to(_KERNEL_DTYPE) for p in high_first]
        per_plane = torch.stack([torch.cat(scales, dim=1), torch.cat(list(grid.zeros), dim=1)], -1)
        self.scale_zeros[:, first_row:stop] = per_plane.transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(_KERNEL_DTYPE)
        if self.planes > 1:
            flat = flat.repeat(1, self.planes)  # each plane multiplies the same input
        out = torch._weight_int4pack_mm_for_cpu(
            flat, self.packed, QUANT_GROUP_SIZE, self.scale_zeros
        ).to(x.dtype)
        bias = _bias_for(self.output_bias, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.rows)


def _bias_for(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A quantized projection's float bias in the activations' dtype."""
    return None if bias is None else bias.to(dtype)


QuantizedLinear = Int4KernelLinear | DequantizingLinear


@dataclass(slots=True)
class _Cache(KVCache):
    """A session's KV cache on one torch shard."""

    inner: Any  # transformers DynamicCache


class TorchShard(ShardPosition):
    """Layers [start, end) of one model on one torch device (ShardBackend)."""

    name = "torch"

    def __init__(self, spec: ShardSpec, device: str) -> None:
        self.spec = spec
        self.device = device
        self.recipe: Recipe = check_recipe(self.name, spec.recipe, device)
        self._dtype = _TORCH_DTYPES[self.recipe.dtype]
        self._torch_device = torch.device(device)
        self._reader = SafetensorsReader(spec.model_dir)
        config, shapes = shard_shapes(spec.model_dir, spec.start, spec.end, self._reader)
        refusal = architectures.recipe_refusal(config, "torch", self.recipe.name)
        if refusal is not None:
            raise BackendError(refusal)
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self._arch = architecture(config)
        self._experts = architectures.num_experts(config)
        self._embed_scale = architectures.embedding_scale(config)
        self._softcap = architectures.final_logit_softcap(config)
        self._window = architectures.sliding_window(config)
        self._hf_config = adapter.load_config(spec.model_dir, self._arch)
        kinds = architectures.layer_kinds(config)
        adapter.check_layer_kinds(self._hf_config, kinds, self._window)
        self._kinds = kinds[spec.start : spec.end]

        self._embed: nn.Module | None = None
        if self.is_first:
            self._embed = self._load_embedding()
        self._layers: list[nn.Module] = []
        for local, layer_idx in enumerate(range(spec.start, spec.end)):
            layer = adapter.build_decoder_layer(self._hf_config, self._arch, layer_idx, local)
            self._layers.append(self._load_module(layer, f"model.layers.{layer_idx}.").eval())
        self._norm: nn.Module | None = None
        self._lm_head: nn.Module | None = None
        if self.is_last:
            norm = adapter.build_norm(self._hf_config, self._arch)
            self._norm = self._load_module(norm, _NORM.removesuffix("weight")).eval()
            self._lm_head = self._load_head(_LM_HEAD if _LM_HEAD in shapes else _EMBED).eval()
        self.bytes_read = self._reader.bytes_read
        self._rotary = adapter.build_rotary(self._hf_config, self._arch, self._torch_device)
        held = {
            t.data_ptr(): t.numel() * t.element_size()
            for module in (self._embed, *self._layers, self._norm, self._lm_head)
            if module is not None
            for t in (*module.parameters(), *module.buffers())
        }
        self.weight_bytes = sum(held.values())  # a tied head shared with the embedding counts once

    def _load_embedding(self) -> nn.Module:
        rows, width = self._reader.shape_of(_EMBED)
        if self.recipe.bits is None:
            return nn.Embedding.from_pretrained(self._dense(_EMBED), freeze=True)
        embedding = QuantizedEmbedding(
            rows, width, _EMBEDDING_BITS, self._torch_device, self._dtype
        )
        self._quantize_into(_EMBED, embedding, _EMBEDDING_BITS)
        return embedding

    def _load_head(self, name: str) -> nn.Module:
        """The LM head from tensor `name` (the embedding's when tied). A
        tied head in a shard that also holds the embedding shares its
        tensor under fp recipes; quantized, it is read again, since the
        kernel's packing cannot serve row lookups."""
        if self.recipe.bits is not None:
            return self._quantized_linear(name)
        head = nn.Linear(self.hidden_size, self.vocab_size, bias=False, device="meta")
        if name == _EMBED and isinstance(self._embed, nn.Embedding):
            weight = self._embed.weight.data
        else:
            weight = self._dense(name)
        adapter.load_state(head, {"weight": weight})
        return head

    def _load_module(self, module: nn.Module, prefix: str) -> nn.Module:
        """Give a meta-device module its tensors `prefix` + parameter name
        (fused expert parameters from their per-expert tensors). Under
        q8/q4 each Linear is first replaced by a quantized one built from
        the checkpoint."""
        if self.recipe.bits is not None:
            for name, child in list(module.named_modules()):
                if isinstance(child, nn.Linear):
                    parent_name, _, attribute = name.rpartition(".")
                    quantized = self._quantized_linear(f"{prefix}{name}.weight")
                    if child.bias is not None:
                        quantized.output_bias = self._dense(f"{prefix}{name}.bias")
                    setattr(module.get_submodule(parent_name), attribute, quantized)
        state = {name: self._parameter(prefix, name) for name, _ in module.named_parameters()}
        adapter.load_state(module, state)
        return module

    def _parameter(self, prefix: str, name: str) -> torch.Tensor:
        """Parameter `name` of the module whose tensors start with `prefix`."""
        sources = adapter.expert_sources(name, self._experts)
        if sources is None:
            return self._dense(prefix + name)
        return self._stacked([[prefix + n for n in group] for group in sources])

    def _stacked(self, groups: list[list[str]]) -> torch.Tensor:
        """Per group, its tensors' rows one after another; the groups
        stacked along a new first dimension (an MoE layer's experts), in
        the recipe's dtype, filled block by block like `_dense`."""
        shapes = [self._reader.shape_of(name) for name in groups[0]]
        rows = sum(shape[0] for shape in shapes)
        out = torch.empty(
            (len(groups), rows, *shapes[0][1:]), dtype=self._dtype, device=self._torch_device
        )
        for index, group in enumerate(groups):
            offset = 0
            for name in group:
                for first_row, block in self._row_blocks(name):
                    out[index, offset + first_row : offset + first_row + len(block)] = block
                offset += self._reader.shape_of(name)[0]
        return out

    def _quantized_linear(self, name: str) -> QuantizedLinear:
        rows, width = self._reader.shape_of(name)
        bits = self.recipe.bits
        assert bits is not None
        if width % QUANT_GROUP_SIZE:
            raise BackendError(
                f"cannot quantize {name!r}: its {width} inputs are not groups of {QUANT_GROUP_SIZE}"
            )
        linear: QuantizedLinear
        if self._torch_device.type == "cpu" and rows % _KERNEL_ROW_MULTIPLE == 0:
            linear = Int4KernelLinear(rows, width, bits)
        else:
            linear = DequantizingLinear(rows, width, bits, self._torch_device)
        self._quantize_into(name, linear, bits)
        return linear

    def _quantize_into(self, name: str, target: PlainAffine | Int4KernelLinear, bits: int) -> None:
        for first_row, block in self._row_blocks(name):
            target.fill(first_row, quantize_rows(block.to(torch.float32), bits))

    def _dense(self, name: str) -> torch.Tensor:
        """Tensor `name` in the recipe's dtype on the shard's device."""
        shape = self._reader.shape_of(name)
        out = torch.empty(shape, dtype=self._dtype, device=self._torch_device)
        for first_row, block in self._row_blocks(name):
            out[first_row : first_row + len(block)] = block
        return out

    def _row_blocks(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) blocks of tensor `name` as CPU tensors in its
        checkpoint dtype, each about _LOAD_BLOCK_BYTES as float32 and a
        multiple of _PACK_ROW_BLOCK rows (but the last)."""
        shape = self._reader.shape_of(name)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * 4
        per_block = max(1, _LOAD_BLOCK_BYTES // row_bytes // _PACK_ROW_BLOCK) * _PACK_ROW_BLOCK
        for first_row in range(0, shape[0], per_block):
            stop = min(first_row + per_block, shape[0])
            yield first_row, _to_torch(name, self._reader.read_rows(name, first_row, stop))

    def new_cache(self) -> _Cache:
        return _Cache(adapter.new_cache())

    def forward(
        self,
        inputs: np.ndarray,
        positions: np.ndarray,
        cache: KVCache,
        *,
        apply_head: bool = True,
    ) -> np.ndarray:
        """ShardBackend.forward. On the last shard, `apply_head=False`
        returns the last layer's hidden states instead of logits (the
        manifest stores them as the golden value at boundary L)."""
        if not isinstance(cache, _Cache):
            raise BackendError("cache was not made by this torch shard")
        hidden = self._input_hidden(inputs)
        tokens = hidden.shape[1]
        positions = np.asarray(positions)
        if positions.shape != (tokens,):
            raise BackendError(f"positions shape {positions.shape} != ({tokens},)")
        past = adapter.cache_length(cache.inner)
        if tokens == 0 or int(positions[0]) != past:
            raise BackendError(f"positions must continue the cache at {past}, got {positions[:1]}")
        with torch.inference_mode():
            position_ids = torch.from_numpy(positions.astype(np.int64)).to(self.device)[None]
            kinds = set(self._kinds)
            masks = adapter.attention_masks(
                self._hf_config, hidden, cache.inner, position_ids, kinds
            )
            rotary = adapter.position_embeddings(
                self._rotary, self._arch, hidden, position_ids, kinds
            )
            for layer, kind in zip(self._layers, self._kinds, strict=True):
                hidden = adapter.run_layer(
                    layer, hidden, masks[kind], rotary[kind], position_ids, cache.inner
                )
            if self.is_last and apply_head:
                return self._head(hidden)
            return hidden[0].float().cpu().numpy()

    def forward_batch(self, steps: Sequence[Step]) -> list[np.ndarray]:
        """ShardBackend.forward_batch: the sessions' steps as one forward of
        right-padded rows (batching.BatchLayout), each row attending to its
        own cache's keys through adapter.BatchCache."""
        caches = [self._own_cache(cache) for _, _, cache in steps]
        if not caches:
            return []
        sessions = [cache.inner for cache in caches]
        rows = batching.layout(steps, [adapter.cache_length(s) for s in sessions])
        with torch.inference_mode():
            hidden = self._batch_hidden([inputs for inputs, _, _ in steps], rows)
            position_ids = torch.from_numpy(rows.position_ids()).to(self.device)
            kinds = set(self._kinds)
            masks = {kind: self._batch_mask(rows, kind) for kind in kinds}
            rotary = adapter.position_embeddings(
                self._rotary, self._arch, hidden, position_ids, kinds
            )
            view = adapter.BatchCache(sessions, rows.counts, rows.key_slots)
            for layer, kind in zip(self._layers, self._kinds, strict=True):
                hidden = adapter.run_layer(
                    layer, hidden, masks[kind], rotary[kind], position_ids, view
                )
            out = self._logits(hidden) if self.is_last else hidden
            batch = out.float().cpu().numpy()
        return [batch[r, :count] for r, count in enumerate(rows.counts)]

    def _batch_mask(self, rows: batching.BatchLayout, kind: str) -> torch.Tensor:
        window = self._window if kind == architectures.SLIDING_ATTENTION else None
        visible = torch.from_numpy(rows.mask(window)).to(self.device)
        return adapter.batch_mask(self._hf_config, visible, self._dtype)

    def _own_cache(self, cache: KVCache) -> _Cache:
        if not isinstance(cache, _Cache):
            raise BackendError("cache was not made by this torch shard")
        return cache

    def _batch_hidden(self, inputs: list[np.ndarray], rows: batching.BatchLayout) -> torch.Tensor:
        """The rows' inputs as one padded batch [rows, width, H] (ids padded
        with 0, hidden states with zeros; padding slots' outputs are
        dropped), checked as `forward` checks each."""
        embedded = [self._input_hidden(row)[0] for row in inputs]
        if rows.width == 1:
            return torch.cat(embedded)[:, None]
        return torch.nn.utils.rnn.pad_sequence(embedded, batch_first=True)

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Final norm and LM head (and the family's softcap) applied to
        hidden states [T, hidden_size] (last shard only): logits
        [T, vocab_size] float32."""
        if not self.is_last:
            raise BackendError("only the last shard has the LM head")
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))
            return self._head(x.to(self.device, self._dtype)[None])

    def _head(self, hidden: torch.Tensor) -> np.ndarray:
        return self._logits(hidden)[0].float().cpu().numpy()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and softcap on hidden states [rows, T, H]."""
        assert self._norm is not None and self._lm_head is not None
        logits = self._lm_head(self._norm(hidden))
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _input_hidden(self, inputs: np.ndarray) -> torch.Tensor:
        inputs = np.asarray(inputs)
        with torch.inference_mode():
            if self.is_first:
                if inputs.ndim != 1 or inputs.dtype.kind not in "iu":
                    raise BackendError(f"first shard takes int token ids [T], got {inputs.dtype}")
                if inputs.size and (inputs.min() < 0 or inputs.max() >= self.vocab_size):
                    raise BackendError(f"token id out of range [0, {self.vocab_size})")
                assert self._embed is not None
                ids = torch.from_numpy(inputs.astype(np.int64)).to(self.device)
                embedded = self._embed(ids)[None]
                if self._embed_scale is not None:
                    # As transformers does: the scale rounded to the weights' dtype.
                    embedded = embedded * torch.tensor(self._embed_scale, dtype=embedded.dtype)
                return embedded
            if inputs.ndim != 2 or inputs.shape[1] != self.hidden_size:
                raise BackendError(
                    f"shard takes hidden states [T, {self.hidden_size}], got {inputs.shape}"
                )
            x = torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.float32))
            return x.to(self.device, self._dtype)[None]

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device": self.device,
            "recipe": self.recipe.name,
            "dtype": self.recipe.dtype,
            "layers": [self.spec.start, self.spec.end],
            "weight_bytes": self.weight_bytes,
            "bytes_read": self.bytes_read,
            "quantization": self._quantization(),
            "torch": torch.__version__,
            "transformers": adapter.TRANSFORMERS_VERSION,
            "machine": platform.machine(),
        }

    def _quantization(self) -> dict[str, Any] | None:
        """How a q8/q4 shard holds and computes its weights: which
        projections run the int4 kernel and which dequantize (say, on a GPU)."""
        if self.recipe.bits is None:
            return None
        parts = (self._embed, *self._layers, self._lm_head)
        modules = [m for part in parts if part is not None for m in part.modules()]
        return {
            "bits": self.recipe.bits,
            "group_size": QUANT_GROUP_SIZE,
            "embedding_bits": _EMBEDDING_BITS if self.is_first else None,
            "int4_kernel_projections": sum(isinstance(m, Int4KernelLinear) for m in modules),
            "dequantizing_projections": sum(isinstance(m, DequantizingLinear) for m in modules),
        }


def _to_torch(name: str, raw: RawTensor) -> torch.Tensor:
    """Checkpoint bytes as a CPU tensor in the checkpoint's dtype."""
    if raw.dtype not in _RAW_DTYPES:
        raise BackendError(f"tensor {name!r} has dtype {raw.dtype}; expected F32, BF16 or F16")
    # bytearray: torch.frombuffer wants a writable buffer; this copies one block.
    return torch.frombuffer(bytearray(raw.data), dtype=_RAW_DTYPES[raw.dtype]).reshape(raw.shape)


def load_torch_shard(spec: ShardSpec, device: str | None = None) -> TorchShard:
    """Load shard `spec` on `device` (default: default_device())."""
    return TorchShard(spec, device or default_device())
