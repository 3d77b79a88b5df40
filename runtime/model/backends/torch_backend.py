"""The torch backend: a span of transformers decoder layers on CUDA, MPS or CPU.

Only the shard's modules are ever built, on the meta device (no memory), and
then given the tensors that runtime.model.weights read for exactly this
shard, so a node serving [a, b) of L layers holds about (b-a)/L of the
weights. The layers are transformers' own classes (the numerics are theirs,
which is what makes the parity test against the full model meaningful);
every call into transformers goes through torch_adapter.

Each session has its own KV cache, a DynamicCache whose slots are local to
the shard (slot 0 is layer `start`).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.model.backends import torch_adapter as adapter
from runtime.model.backends.base import BackendError, KVCache, ShardPosition, ShardSpec
from runtime.model.recipes import QUANT_GROUP_SIZE, Recipe, check_recipe
from runtime.model.weights import RawTensor, SafetensorsReader, architecture, read_shard_tensors

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_RAW_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# Tensor-name prefixes of each module a shard may own.
_EMBED = "model.embed_tokens.weight"
_NORM = "model.norm.weight"
_LM_HEAD = "lm_head.weight"


def default_device() -> str:
    """The best device here: CUDA, then Apple's MPS, then the CPU."""
    if torch.cuda.is_available():
        return "cuda:0"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


class QuantizedLinear(nn.Module):
    """A bias-free linear layer whose weight is stored as `bits`-bit affine
    groups (MLX's scheme: per group of QUANT_GROUP_SIZE input weights,
    w ~ q * scale + bias with q in [0, 2^bits - 1]). The weight is unpacked
    for each matmul; see runtime/model/recipes.py for why this and not a library."""

    # Registered buffers (register_buffer below), declared so the type checker
    # sees tensors rather than nn.Module.__getattr__'s `Tensor | Module`.
    packed: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor

    def __init__(self, weight: torch.Tensor, bits: int, compute_dtype: torch.dtype) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % QUANT_GROUP_SIZE:
            raise BackendError(
                f"cannot quantize a {in_features}-wide weight in groups of {QUANT_GROUP_SIZE}"
            )
        self.bits = bits
        self.shape = (out_features, in_features)
        self.compute_dtype = compute_dtype
        levels = (1 << bits) - 1
        groups = weight.float().reshape(out_features, -1, QUANT_GROUP_SIZE)
        low = groups.amin(dim=-1, keepdim=True)
        scale = (groups.amax(dim=-1, keepdim=True) - low).clamp_min(torch.finfo(torch.float32).tiny)
        scale = scale / levels
        q = torch.round((groups - low) / scale).clamp(0, levels).to(torch.uint8)
        per_byte = 8 // bits
        q = q.reshape(out_features, -1, per_byte)
        packed = q[..., 0]
        for k in range(1, per_byte):
            packed = packed | (q[..., k] << (bits * k))
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scale", scale.to(compute_dtype))
        self.register_buffer("low", low.to(compute_dtype))

    def dequantized(self) -> torch.Tensor:
        """The weight as the matmul sees it."""
        per_byte = 8 // self.bits
        mask = (1 << self.bits) - 1
        parts = [(self.packed >> (self.bits * k)) & mask for k in range(per_byte)]
        q = torch.stack(parts, dim=-1).reshape(self.shape[0], -1, QUANT_GROUP_SIZE)
        return (q.to(self.compute_dtype) * self.scale + self.low).reshape(self.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized())


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
        reader = SafetensorsReader(spec.model_dir)
        config, raw = read_shard_tensors(spec.model_dir, spec.start, spec.end, reader)
        self.bytes_read = reader.bytes_read
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self._arch = architecture(config)
        self._hf_config = adapter.load_config(spec.model_dir)
        torch_device = torch.device(device)
        tensors = {name: _to_torch(name, t, torch_device, self._dtype) for name, t in raw.items()}

        self._embed: nn.Embedding | None = None
        if self.is_first:
            self._embed = nn.Embedding.from_pretrained(tensors[_EMBED], freeze=True)
        self._layers: list[nn.Module] = []
        for local, layer_idx in enumerate(range(spec.start, spec.end)):
            layer = adapter.build_decoder_layer(self._hf_config, self._arch, layer_idx, local)
            prefix = f"model.layers.{layer_idx}."
            adapter.load_state(
                layer, {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
            )
            self._layers.append(self._quantize(layer).eval())
        self._norm: nn.Module | None = None
        self._lm_head: nn.Module | None = None
        if self.is_last:
            self._norm = adapter.build_norm(self._hf_config, self._arch)
            adapter.load_state(self._norm, {"weight": tensors[_NORM]})
            head = tensors[_EMBED if _LM_HEAD not in tensors else _LM_HEAD]
            lm_head = nn.Linear(self.hidden_size, self.vocab_size, bias=False, device="meta")
            adapter.load_state(lm_head, {"weight": head})
            self._lm_head = self._quantize(lm_head).eval()
        self._rotary = adapter.build_rotary(self._hf_config, self._arch, torch_device)
        self.weight_bytes = sum(
            t.numel() * t.element_size()
            for module in (self._embed, *self._layers, self._norm, self._lm_head)
            if module is not None
            for t in (*module.parameters(), *module.buffers())
        )

    def _quantize(self, module: nn.Module) -> nn.Module:
        """Swap every bias-free Linear for a QuantizedLinear under q8/q4 (the
        embeddings stay unquantized: a row lookup costs nothing to keep)."""
        if self.recipe.bits is None:
            return module
        if isinstance(module, nn.Linear):
            return self._quantized_linear(module)
        for name, child in list(module.named_modules()):
            if isinstance(child, nn.Linear):
                parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
                setattr(parent, name.rpartition(".")[2], self._quantized_linear(child))
        return module

    def _quantized_linear(self, linear: nn.Linear) -> QuantizedLinear:
        if linear.bias is not None:
            raise BackendError("quantized recipes need bias-free projections")
        return QuantizedLinear(linear.weight.data, self.recipe.bits or 0, self._dtype)

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
            mask = adapter.causal_mask(self._hf_config, hidden, cache.inner, position_ids)
            rotary = self._rotary(hidden, position_ids)
            for layer in self._layers:
                hidden = adapter.run_layer(layer, hidden, mask, rotary, position_ids, cache.inner)
            if self.is_last and apply_head:
                return self._head(hidden)
            return hidden[0].float().cpu().numpy()

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Final norm and LM head applied to hidden states [T, hidden_size]
        (last shard only): logits [T, vocab_size] float32."""
        if not self.is_last:
            raise BackendError("only the last shard has the LM head")
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))
            return self._head(x.to(self.device, self._dtype)[None])

    def _head(self, hidden: torch.Tensor) -> np.ndarray:
        assert self._norm is not None and self._lm_head is not None
        return self._lm_head(self._norm(hidden))[0].float().cpu().numpy()

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
                return self._embed(ids)[None]
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
            "torch": torch.__version__,
            "transformers": adapter.TRANSFORMERS_VERSION,
            "machine": platform.machine(),
        }


def _to_torch(name: str, raw: RawTensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as a torch tensor in the recipe's dtype."""
    if raw.dtype not in _RAW_DTYPES:
        raise BackendError(f"tensor {name!r} has dtype {raw.dtype}; expected F32, BF16 or F16")
    tensor = torch.frombuffer(bytearray(raw.data), dtype=_RAW_DTYPES[raw.dtype])
    return tensor.reshape(raw.shape).to(device=device, dtype=dtype)


def load_torch_shard(spec: ShardSpec, device: str | None = None) -> TorchShard:
    """Load shard `spec` on `device` (default: default_device())."""
    return TorchShard(spec, device or default_device())
