"""Every call into mlx-lm's internals, in one place.

mlx-lm's per-family modules (`mlx_lm.models.qwen3`, `mlx_lm.models.llama`)
are not a stable API: ModelArgs fields, TransformerBlock signatures, the
cache classes and mask helpers change between minor releases. Keeping them
behind this module means an mlx-lm upgrade touches one file, and the parity
tests in tests/test_runtime_mlx.py say whether it still works. Covered
version: mlx-lm 0.32.x (with mlx 0.32.x).

This module imports mlx at import time; `runtime.model.backends.mlx_backend`
imports it only after checking that mlx is installed.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama, qwen3
from mlx_lm.models.base import create_attention_mask

from runtime.model.backends.base import BackendError

FAMILIES: dict[str, ModuleType] = {"qwen3": qwen3, "llama": llama}


def _family(config: dict[str, Any]) -> ModuleType:
    model_type = config.get("model_type")
    module = FAMILIES.get(str(model_type))
    if module is None:
        raise BackendError(
            f"backend mlx does not support architecture {model_type!r} "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    return module


def model_args(config: dict[str, Any]) -> Any:
    """mlx-lm ModelArgs for an HF config.json, refusing what the shard cannot
    reproduce faithfully.

    transformers 5 nests rope_theta (and the scaling type) under
    `rope_parameters`; mlx-lm's qwen3 args understand that but its llama args
    do not and would silently fall back to theta 10000, so the nested values
    are lifted here for every family.
    """
    module = _family(config)
    if config.get("hidden_act", "silu") != "silu":
        raise BackendError(f"backend mlx supports only silu MLPs, not {config['hidden_act']!r}")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise BackendError("backend mlx shards support only full-attention layers")
    if module is qwen3 and config.get("attention_bias"):
        raise BackendError("mlx-lm's qwen3 has no attention bias; this checkpoint needs one")
    params = dict(config)
    rope = params.get("rope_parameters") or {}
    if params.get("rope_theta") is None and "rope_theta" in rope:
        params["rope_theta"] = rope["rope_theta"]
    if params.get("rope_scaling") is None and rope:
        params["rope_scaling"] = rope
    try:
        return module.ModelArgs.from_dict(params)
    except (TypeError, ValueError) as exc:
        raise BackendError(
            f"config.json is not a usable {config['model_type']} config: {exc}"
        ) from exc


class ShardModel(nn.Module):
    """Decoder layers [start, end) of one model, built from mlx-lm's own
    TransformerBlock so the arithmetic is exactly mlx-lm's.

    Parameter names mirror the HF checkpoint with the `model.` prefix dropped
    and layer indices made local (`layers.0` is global layer `start`), so
    weights map one to one. The first shard owns `embed_tokens`; the last
    owns `norm` and an explicit `lm_head` (filled from the embedding matrix
    when the model ties them), so a last shard never needs the embedding
    module itself.
    """

    def __init__(self, args: Any, start: int, end: int) -> None:
        super().__init__()
        module = FAMILIES[args.model_type]
        self.first = start == 0
        self.last = end == args.num_hidden_layers
        if self.first:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [module.TransformerBlock(args) for _ in range(start, end)]
        if self.last:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        """x: [1, T] token ids on the first shard, else [1, T, H] hidden
        states. The mask is mlx-lm's own: none for one token, else "causal",
        which mlx's fused attention aligns to the end of the cached keys, so
        a multi-token step on top of earlier tokens sees all of them and
        none of its own future (the parity test's second chunk checks it)."""
        h = self.embed_tokens(x) if self.first else x
        mask = create_attention_mask(h, cache[0])
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, mask, layer_cache)
        if self.last:
            h = self.lm_head(self.norm(h))
        return h


def new_layer_caches(count: int) -> list[Any]:
    """One mlx-lm KVCache per local layer: the per-session state of a shard."""
    return [mlx_cache.KVCache() for _ in range(count)]


def cache_offset(caches: list[Any]) -> int:
    """How many tokens the session's cache already holds."""
    return int(caches[0].offset)


def eval_step(out: mx.array, caches: list[Any]) -> None:
    """Evaluate the step's output together with the cache updates, so the
    lazy graph does not grow across decode steps."""
    mx.eval(out, [c.state for c in caches])
