"""The MLX backend: one shard of a model on mlx (Metal on Apple silicon, the
CPU build on Linux), computed with mlx-lm's own layer classes.

Only the shard's tensors are read (runtime.model.weights), so memory is
proportional to the shard, not the model. Recipes map onto MLX natively:
fp32/bf16/fp16 are weight and activation dtypes, q8/q4 are mlx's affine
group quantization of the Linear weights and of MoE experts
(`mlx.nn.quantize`) with float32 activations.

This module imports without mlx installed, so the backend registry and the
doctor can report "not installed" as a BackendError instead of crashing;
mlx and the mlx-lm adapter are imported when a shard is loaded.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from runtime.model import architectures
from runtime.model.backends import batching
from runtime.model.backends.base import BackendError, KVCache, ShardPosition, ShardSpec
from runtime.model.backends.batching import Step
from runtime.model.recipes import QUANT_GROUP_SIZE, Recipe, check_recipe
from runtime.model.weights import SafetensorsReader, read_config, read_shard_tensors

if TYPE_CHECKING:
    import mlx.core as mx

    from runtime.model.weights import RawTensor

NAME = "mlx"

_NUMPY_STORAGE = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _require_mlx() -> None:
    """Raise an operator-readable BackendError when mlx or mlx-lm is missing."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        if sys.platform == "darwin" and platform.machine() == "arm64":
            hint = "pip install mlx mlx-lm"
        else:
            hint = "pip install 'mlx[cpu]' mlx-lm"
        raise BackendError(f"backend mlx is not installed: {hint} ({exc})") from exc


def _to_mx(name: str, raw: RawTensor, dtype: mx.Dtype) -> mx.array:
    """RawTensor bytes -> mx array in the recipe's dtype. bf16 has no NumPy
    dtype, so it travels as uint16 and is reinterpreted by mlx."""
    import mlx.core as mx

    storage = _NUMPY_STORAGE.get(raw.dtype)
    if storage is None:
        raise BackendError(f"tensor {name} has dtype {raw.dtype}; backend mlx reads F32, F16, BF16")
    array = mx.array(np.frombuffer(raw.data, dtype=storage).reshape(raw.shape))
    if raw.dtype == "BF16":
        array = array.view(mx.bfloat16)
    return array.astype(dtype)


def _local_name(hf_name: str, start: int) -> str:
    """The shard module's parameter name for one checkpoint tensor: `model.`
    dropped, layer indices made local to the shard."""
    if hf_name.startswith("model.layers."):
        index, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        return f"layers.{int(index) - start}.{rest}"
    return hf_name.removeprefix("model.")


def _quantize(model: Any, bits: int) -> dict[str, int]:
    """Affine group quantization of every Linear (projections and LM head)
    and every MoE layer's experts, in the group size both backends share
    (an MoE router at 8 bits, as mlx-lm keeps it;
    `mlx_adapter.quantization_predicate`). The embedding stays unquantized
    (torch keeps it at 8 bits to fit q4's memory target; a row lookup costs
    MLX nothing to keep exact). Quantizing the projections onto the same
    grid is what lets the two backends' q8/q4 shards interoperate within
    the doctor's calibrated bounds. A model whose input dims the group
    does not divide is refused rather than quantized differently."""
    import mlx.nn as nn

    from runtime.model.backends import mlx_adapter

    dims = mlx_adapter.quantizable_input_dims(model)
    if any(dim % QUANT_GROUP_SIZE for dim in dims):
        raise BackendError(
            f"backend mlx cannot quantize this model in group size {QUANT_GROUP_SIZE}: "
            f"input dims {sorted(dims)} are not all multiples of it"
        )
    nn.quantize(
        model,
        group_size=QUANT_GROUP_SIZE,
        bits=bits,
        class_predicate=mlx_adapter.quantization_predicate,
    )
    return {"bits": bits, "group_size": QUANT_GROUP_SIZE}


@dataclass
class MlxCache(KVCache):
    """One session's KV cache on an MLX shard: an mlx-lm KVCache per local
    layer, indexed 0..end-start."""

    layers: list[Any] = field(repr=False)

    @property
    def offset(self) -> int:
        """Tokens already cached."""
        from runtime.model.backends import mlx_adapter

        return mlx_adapter.cache_offset(self.layers)


class MlxShard(ShardPosition):
    """Layers [start, end) of one model on MLX, implementing ShardBackend."""

    name = NAME

    def __init__(
        self,
        spec: ShardSpec,
        recipe: Recipe,
        config: dict[str, Any],
        model: Any,
        quantization: dict[str, int] | None,
        bytes_read: int,
    ) -> None:
        import mlx.core as mx

        self.spec = spec
        self.recipe = recipe
        self.config = config
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self.device = mx.default_device().type.name
        self._model = model
        self._dtype = getattr(mx, recipe.dtype)
        self._quantization = quantization
        self.bytes_read = bytes_read

    def new_cache(self) -> MlxCache:
        from runtime.model.backends import mlx_adapter

        return MlxCache(mlx_adapter.new_layer_caches(self.spec.end - self.spec.start))

    def _check_inputs(self, inputs: np.ndarray, positions: np.ndarray, cache: KVCache) -> MlxCache:
        """Refuse malformed steps loudly: mlx-lm derives RoPE positions from
        the cache offset, so positions that do not continue the cache would
        otherwise be silently wrong. Returns `cache` as this backend's own
        cache type."""
        if not isinstance(cache, MlxCache):
            raise BackendError(f"backend mlx got a foreign cache handle {type(cache).__name__}")
        if self.is_first:
            if inputs.ndim != 1 or not np.issubdtype(inputs.dtype, np.integer):
                raise BackendError(
                    f"first shard takes int token ids [T], got {inputs.dtype} {inputs.shape}"
                )
            if inputs.size and not 0 <= int(inputs.min()) <= int(inputs.max()) < self.vocab_size:
                # mlx does not bounds-check a gather; it would read garbage.
                raise BackendError(f"token ids must lie in [0, {self.vocab_size})")
        elif inputs.ndim != 2 or inputs.shape[1] != self.hidden_size:
            raise BackendError(
                f"shard takes hidden states [T, {self.hidden_size}], got {inputs.shape}"
            )
        steps = inputs.shape[0]
        if steps == 0:
            raise BackendError("forward needs at least one token")
        expected = np.arange(cache.offset, cache.offset + steps)
        if positions.shape != (steps,) or not np.array_equal(positions, expected):
            raise BackendError(
                f"positions must continue the cache ({cache.offset}..{cache.offset + steps - 1}), "
                f"got {positions.tolist()}"
            )
        return cache

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        import mlx.core as mx

        from runtime.model.backends import mlx_adapter

        own = self._check_inputs(inputs, positions, cache)
        if self.is_first:
            x = mx.array(inputs.astype(np.int32))[None]
        else:
            x = mx.array(inputs.astype(np.float32, copy=False))[None].astype(self._dtype)
        out = self._model(x, own.layers)[0].astype(mx.float32)
        mlx_adapter.eval_step(out, own.layers)
        return np.array(out)

    def forward_batch(self, steps: Sequence[Step]) -> list[np.ndarray]:
        """ShardBackend.forward_batch: the sessions' steps as one forward of
        right-padded rows (batching.BatchLayout), each row attending to its
        own cache's keys through mlx_adapter.BatchLayerCache."""
        import mlx.core as mx

        from runtime.model.backends import mlx_adapter

        caches = [self._check_inputs(np.asarray(i), np.asarray(p), c) for i, p, c in steps]
        if not caches:
            return []
        rows = batching.layout(steps, [cache.offset for cache in caches])
        inputs = rows.padded([np.asarray(inputs) for inputs, _, _ in steps])
        if self.is_first:
            x = mx.array(inputs.astype(np.int32))
        else:
            x = mx.array(inputs.astype(np.float32, copy=False)).astype(self._dtype)
        views = self._model.batch_caches([cache.layers for cache in caches], rows)
        out = self._model(x, views).astype(mx.float32)
        mlx_adapter.eval_step(out, [layer for cache in caches for layer in cache.layers])
        batch = np.array(out)
        return [batch[r, :count] for r, count in enumerate(rows.counts)]

    @property
    def weight_bytes(self) -> int:
        """Bytes of parameters this shard holds (after quantization); a tied
        embedding shared with the LM head counts once."""
        from mlx.utils import tree_flatten

        # tree_flatten is annotated `list[tuple[str, Any]] | dict[str, Any]`;
        # without `destination` it always returns the list.
        flat = cast("list[tuple[str, mx.array]]", tree_flatten(self._model.parameters()))
        arrays = {id(v): v for _, v in flat}
        return sum(int(v.nbytes) for v in arrays.values())

    def info(self) -> dict[str, Any]:
        return {
            "backend": NAME,
            "device": self.device,
            "model_type": self.config.get("model_type"),
            "layers": [self.spec.start, self.spec.end],
            "num_layers": self.num_layers,
            "recipe": self.spec.recipe,
            "dtype": self.recipe.dtype,
            "quantization": self._quantization,
            "weight_bytes": self.weight_bytes,
            "bytes_read": self.bytes_read,
            "versions": {pkg: metadata.version(pkg) for pkg in ("mlx", "mlx-lm")},
        }


def load_mlx_shard(spec: ShardSpec) -> MlxShard:
    """Build layers [start, end) with mlx-lm's classes and load only their
    tensors (plus embeddings on the first shard, final norm and LM head on
    the last), in the spec's recipe. Raises BackendError for anything an
    operator must fix: mlx missing, unsupported recipe or architecture, bad
    span, missing or misshapen tensor."""
    _require_mlx()
    import mlx.core as mx

    from runtime.model.backends import mlx_adapter

    device = mx.default_device().type.name
    recipe = check_recipe(NAME, spec.recipe, device)
    experts = architectures.family(read_config(spec.model_dir)).experts
    if experts and device == "cpu" and recipe.dtype != "float32":
        # Else found mid-forward, as "[GatherMM::eval] Currently only
        # supports float32"; refused here, before anything is read.
        raise BackendError(
            f"backend mlx on cpu runs mixture-of-experts layers in float32 only "
            f"(mlx's CPU gather_mm), not recipe {recipe.name}; use fp32, q8 or q4"
        )
    reader = SafetensorsReader(spec.model_dir)
    config, raw = read_shard_tensors(spec.model_dir, spec.start, spec.end, reader)
    args = mlx_adapter.model_args(config)
    num_layers = int(config["num_hidden_layers"])
    dtype = getattr(mx, recipe.dtype)
    weights = {_local_name(name, spec.start): _to_mx(name, t, dtype) for name, t in raw.items()}
    if spec.end == num_layers and config.get("tie_word_embeddings"):
        # The reader gave the last shard the embedding matrix as its LM head.
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
        if spec.start != 0:
            del weights["embed_tokens.weight"]

    model = mlx_adapter.ShardModel(config, args, spec.start, spec.end)
    try:
        model.load_weights(list(mlx_adapter.module_weights(weights).items()), strict=True)
    except ValueError as exc:
        raise BackendError(f"shard [{spec.start}, {spec.end}) of {spec.model_dir}: {exc}") from exc

    quantization = _quantize(model, recipe.bits) if recipe.bits else None
    model.eval()
    mx.eval(model.parameters())
    return MlxShard(spec, recipe, config, model, quantization, reader.bytes_read)
