"""Every call into mlx-lm's internals, in one place.

mlx-lm's per-family modules are not a stable API (ModelArgs fields, block
signatures, caches and mask helpers change between minor releases), so an
upgrade touches this one file; the parity tests say whether it still works.
Covered version: mlx-lm 0.32.x (with mlx 0.32.x). `FAMILIES` names the
mlx-lm classes that compute each family's layers (the family's facts are in
runtime/model/architectures.py) and the settings they cannot follow,
refused, never approximated. This module imports mlx at import time;
`runtime.model.backends.mlx_backend` imports it only once mlx is known to be
installed. More: docs/design/models.md#the-backend-adapters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gemma2, gemma3_text, llama, phi3, qwen2, qwen3, qwen3_moe
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.switch_layers import SwitchLinear

from runtime.model import architectures
from runtime.model.architectures import FULL_ATTENTION, SLIDING_ATTENTION
from runtime.model.backends.base import BackendError
from runtime.model.backends.batching import BatchLayout
from runtime.model.recipes import QUANT_GROUP_SIZE
from runtime.model.weights import head_dim

# A setting an mlx-lm module would compute differently from transformers:
# (is it present in this config, why it is refused).
_Refusal = tuple[Callable[[dict[str, Any]], bool], str]


@dataclass(frozen=True, slots=True)
class _Family:
    """The mlx-lm classes that compute one architecture's layers."""

    module: ModuleType
    block: str = "TransformerBlock"  # the decoder layer's class in `module`
    block_takes_index: bool = False  # built as block(args, layer_idx)
    norm: Callable[..., nn.Module] = nn.RMSNorm  # the final norm, as norm(dims, eps=eps)
    activation: str = "silu"  # the MLP activation the module hard-codes
    # The module honours config.json's `attention_bias` / `mlp_bias`.
    biases: bool = False
    # Its attention takes a mask array only (not mlx's "causal" shortcut).
    mask_array: bool = False
    refusals: tuple[_Refusal, ...] = ()


_GELU_TANH = "gelu_pytorch_tanh"  # what mlx's nn.gelu_approx computes

# Rotary scaling types whose mlx-lm implementation the parity tests hold to
# transformers' (tests/runtime/model/test_architectures.py: Llama 3.1's, Gemma 3's linear
# global layers). Others are refused: mlx-lm's longrope, for one, applies
# the long factors at every length where transformers uses the short ones
# below the original context.
_ROPE_TYPES = ("default", "linear", "llama3")

FAMILIES: dict[str, _Family] = {
    "Qwen3ForCausalLM": _Family(qwen3),
    "LlamaForCausalLM": _Family(llama, biases=True),
    "MistralForCausalLM": _Family(llama),  # mlx-lm maps "mistral" onto llama
    "Qwen2ForCausalLM": _Family(qwen2),
    "Gemma2ForCausalLM": _Family(
        gemma2,
        norm=gemma2.RMSNorm,
        activation=_GELU_TANH,
        mask_array=True,
        refusals=(
            (
                lambda c: c.get("attn_logit_softcapping") is None,
                "mlx-lm's gemma2 always softcaps attention logits; this config does not",
            ),
        ),
    ),
    "Gemma3ForCausalLM": _Family(
        gemma3_text,
        block_takes_index=True,
        norm=gemma3_text.RMSNorm,
        activation=_GELU_TANH,
        refusals=(
            (
                lambda c: c.get("attn_logit_softcapping") is not None,
                "mlx-lm's gemma3 does not softcap attention logits; this config does",
            ),
            (
                lambda c: (
                    architectures.rope_parameters(c, SLIDING_ATTENTION).get("rope_type")
                    not in (None, "default")
                ),
                "mlx-lm's gemma3 rotates local layers without scaling; this config scales them",
            ),
        ),
    ),
    "Phi3ForCausalLM": _Family(
        phi3,
        refusals=(
            (
                lambda c: head_dim(c) * c["num_attention_heads"] != c["hidden_size"],
                "mlx-lm's phi3 derives head_dim from hidden_size; this config sets another",
            ),
        ),
    ),
    "Qwen3MoeForCausalLM": _Family(qwen3_moe, block="Qwen3MoeDecoderLayer", block_takes_index=True),
}

# A checkpoint's per-expert tensor, local to the shard, and the stacked
# parameter of mlx-lm's SwitchGLU it becomes part of.
_EXPERT_TENSOR = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER_SUFFIX = "mlp.gate"
# mlx-lm quantizes an MoE router at 8 bits whatever the recipe (a coarser
# router picks other experts, not just slightly other numbers); so do we.
_ROUTER_BITS = 8


def _family(config: dict[str, Any]) -> _Family:
    arch = architectures.family(config).architecture
    found = FAMILIES.get(arch)
    if found is None:
        raise BackendError(
            f"backend mlx does not support architecture {arch} (supported: {', '.join(FAMILIES)})"
        )
    return found


def model_args(config: dict[str, Any]) -> Any:
    """mlx-lm ModelArgs for a config read with `weights.read_config`,
    refusing what the shard cannot reproduce faithfully.

    transformers 5 nests rope_theta (and the scaling type) under
    `rope_parameters`, per layer kind for Gemma 3; mlx-lm's args read them
    at the top level (its llama args would silently fall back to theta
    10000), so they are lifted here for every family.
    """
    family = _family(config)
    arch = architectures.family(config).architecture
    activation = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if activation != family.activation:
        raise BackendError(
            f"backend mlx computes {arch} MLPs with {family.activation}, not {activation!r}"
        )
    if not family.biases and (config.get("attention_bias") or config.get("mlp_bias")):
        raise BackendError(f"mlx-lm's {family.module.__name__} has no projection biases")
    for applies, why in family.refusals:
        if applies(config):
            raise BackendError(f"backend mlx cannot run this {arch}: {why}")
    params = dict(config)
    rope = architectures.rope_parameters(config, FULL_ATTENTION)
    params["rope_theta"] = rope["rope_theta"]
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise BackendError(
            f"backend mlx does not run rotary scaling {rope_type!r} as transformers does "
            f"(it runs {', '.join(_ROPE_TYPES)}); serve this model on torch"
        )
    # mlx-lm's phi3 reads the scaling type under "type" only.
    params["rope_scaling"] = None if rope_type == "default" else {**rope, "type": rope_type}
    params["partial_rotary_factor"] = rope.get(
        "partial_rotary_factor", config.get("partial_rotary_factor", 1.0)
    )
    if family.module is gemma3_text:
        params["rope_local_base_freq"] = architectures.rope_parameters(config, SLIDING_ATTENTION)[
            "rope_theta"
        ]
        params["sliding_window_pattern"] = _gemma3_pattern(architectures.layer_kinds(config))
    if architectures.family(config).experts:
        params["num_experts"] = architectures.num_experts(config)
    try:
        return family.module.ModelArgs.from_dict(params)
    except (TypeError, ValueError) as exc:
        raise BackendError(f"config.json is not a usable {arch} config: {exc}") from exc


def _gemma3_pattern(kinds: list[str]) -> int:
    """mlx-lm's gemma3 picks each layer's rotary base from a period (layer
    i is global when (i + 1) is a multiple of it); the period that gives
    these kinds, or BackendError when none does."""
    pattern = kinds.index(FULL_ATTENTION) + 1 if FULL_ATTENTION in kinds else len(kinds) + 1
    expected = [
        FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(len(kinds))
    ]
    if kinds != expected:
        raise BackendError(f"mlx-lm's gemma3 needs periodic layer types, not {kinds}")
    return pattern


class ShardModel(nn.Module):
    """Decoder layers [start, end) of one model, built from mlx-lm's own
    layer classes so the arithmetic inside a layer is exactly mlx-lm's.

    Parameter names mirror the HF checkpoint with the `model.` prefix dropped
    and layer indices made local (`layers.0` is global layer `start`), so
    weights map one to one (`module_weights` stacks an MoE layer's experts
    as mlx-lm keeps them). The first shard owns `embed_tokens`; the last
    owns `norm` and an explicit `lm_head` (filled from the embedding matrix
    when the model ties them), so a last shard never needs the embedding
    module itself.
    """

    def __init__(self, config: dict[str, Any], args: Any, start: int, end: int) -> None:
        super().__init__()
        family = _family(config)
        self.first = start == 0
        self.last = end == config["num_hidden_layers"]
        self.kinds = tuple(architectures.layer_kinds(config)[start:end])
        self.window = architectures.sliding_window(config)
        self.embed_scale = architectures.embedding_scale(config)
        self.softcap = architectures.final_logit_softcap(config)
        self.mask_array = family.mask_array
        # Its attention masks scores grouped [B, kv_heads, repeats, T, K]
        # (gemma2 with more query heads than key heads), so a per-row mask
        # needs one more axis there.
        self.grouped_scores = (
            family.mask_array and args.num_attention_heads > args.num_key_value_heads
        )
        if self.first:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        block = getattr(family.module, family.block)
        self.layers = [
            block(args, i) if family.block_takes_index else block(args) for i in range(start, end)
        ]
        if self.last:
            self.norm = family.norm(args.hidden_size, eps=args.rms_norm_eps)
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        """x: [1, T] token ids on the first shard, else [1, T, H] hidden
        states. Masks are mlx-lm's own, one per layer kind: for full layers
        none for one token, else "causal" (or its array where the family
        needs one), which mlx's fused attention aligns to the end of the
        cached keys, so a multi-token step on top of earlier tokens sees
        all of them and none of its own future (the parity tests' second
        chunk checks it); for sliding layers an array that also hides keys
        `window` or more positions back."""
        h = x
        if self.first:
            h = self.embed_tokens(x)
            if self.embed_scale is not None:
                # As transformers does: the scale rounded to the weights' dtype.
                h = h * mx.array(self.embed_scale, dtype=h.dtype)
        masks = {
            kind: create_attention_mask(
                h,
                cache[self.kinds.index(kind)],
                window_size=self.window if kind == SLIDING_ATTENTION else None,
                return_array=self.mask_array,
            )
            for kind in set(self.kinds)
        }
        for layer, layer_cache, kind in zip(self.layers, cache, self.kinds, strict=True):
            h = layer(h, masks[kind], layer_cache)
        if self.last:
            h = self.lm_head(self.norm(h))
            if self.softcap is not None:
                h = mx.tanh(h / self.softcap) * self.softcap
        return h

    def batch_caches(self, sessions: list[list[Any]], rows: BatchLayout) -> list[BatchLayerCache]:
        """Per local layer, the view of every session's cache for one
        batched step of `rows` (session r's caches are `sessions[r]`)."""
        return [
            BatchLayerCache([caches[index] for caches in sessions], rows, self.grouped_scores)
            for index in range(len(self.layers))
        ]


class BatchLayerCache:
    """One layer's caches of several sessions seen as one batch for one
    step, in place of an mlx-lm cache (its layers call `offset`,
    `update_and_fetch`, and `make_mask` through `create_attention_mask`).
    `offset` is every row's own position for the rotary embedding (mlx's
    rope takes one offset per row, as mlx-lm's BatchKVCache relies on);
    `update_and_fetch` appends row r's real new keys (not its padding) to
    session r's own KVCache and returns all rows' keys right-padded with
    zeros to the layout's key slots; `make_mask` is the layout's mask."""

    def __init__(self, sessions: list[Any], rows: BatchLayout, grouped_scores: bool) -> None:
        self.sessions = sessions
        self.rows = rows
        self.offset = mx.array(rows.past)
        self.grouped_scores = grouped_scores

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fetched = [
            session.update_and_fetch(keys[r : r + 1, :, :count], values[r : r + 1, :, :count])
            for r, (session, count) in enumerate(zip(self.sessions, self.rows.counts, strict=True))
        ]
        slots = self.rows.key_slots
        keys = right_padded([k for k, _ in fetched], slots)
        return keys, right_padded([v for _, v in fetched], slots)

    def make_mask(self, n: int, window_size: int | None = None, **_: Any) -> mx.array:
        """The layout's boolean mask [rows, 1, T, keys] (one more axis for
        grouped scores); `n`, the batch's query slots, is the layout's width."""
        mask = mx.array(self.rows.mask(window_size))
        return mask[:, :, None] if self.grouped_scores else mask


def right_padded(rows: list[mx.array], slots: int) -> mx.array:
    """[1, heads, L_r, dim] per row -> [rows, heads, slots, dim], zeros after
    each row's own. Written row by row into zeros: on mlx's CPU build a
    quarter of the time of padding each row and concatenating them."""
    _, heads, _, dim = rows[0].shape
    out = mx.zeros((len(rows), heads, slots, dim), rows[0].dtype)
    for r, row in enumerate(rows):
        out[r : r + 1, :, : row.shape[2]] = row
    return out


def cached_keys(caches: list[Any]) -> list[tuple[mx.array, mx.array]]:
    """A session's keys and values [1, heads, L, dim], per local layer."""
    return [cache.keys_and_values() for cache in caches]


def module_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Shard-local checkpoint tensors as ShardModel's parameters: an MoE
    layer's per-expert projections stacked, in expert order, into mlx-lm's
    SwitchGLU matrices (`mlp.switch_mlp.gate_proj.weight` [experts, out,
    in], ...); every other tensor as it is."""
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for name, array in weights.items():
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            out[name] = array
            continue
        mlp, expert, projection = match.groups()
        experts.setdefault(f"{mlp}.switch_mlp.{projection}.weight", {})[int(expert)] = array
    for name, by_expert in experts.items():
        out[name] = mx.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def quantizable_input_dims(model: nn.Module) -> set[int]:
    """Input widths of the modules `quantization_predicate` quantizes."""
    return {
        m.weight.shape[-1]
        for _, m in model.named_modules()
        if isinstance(m, (nn.Linear, SwitchLinear))
    }


def quantization_predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
    """For `mlx.nn.quantize`: every Linear and every SwitchLinear (an MoE
    layer's experts) at the recipe's bits, an MoE router at _ROUTER_BITS;
    the embedding stays as it is."""
    if not isinstance(module, (nn.Linear, SwitchLinear)):
        return False
    if path.endswith(_ROUTER_SUFFIX):
        return {"group_size": QUANT_GROUP_SIZE, "bits": _ROUTER_BITS, "mode": "affine"}
    return True


def new_layer_caches(count: int) -> list[Any]:
    """One mlx-lm KVCache per local layer: the per-session state of a shard.
    Sliding layers keep all their keys too; their mask hides the old ones."""
    return [mlx_cache.KVCache() for _ in range(count)]


def cache_offset(caches: list[Any]) -> int:
    """How many tokens the session's cache already holds."""
    return int(caches[0].offset)


def eval_step(out: mx.array, caches: list[Any]) -> None:
    """Evaluate the step's output together with the cache updates, so the
    lazy graph does not grow across decode steps."""
    mx.eval(out, [c.state for c in caches])
