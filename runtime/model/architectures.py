"""What differs between the model families a shard can serve, in one table.

Every family is a pre-norm decoder with RMSNorm, rotary positions,
grouped-query attention and a gated MLP; `FAMILIES` holds, per Hugging Face
architecture name, the few facts that set one apart: the checkpoint's
layout (q/k norms, biases, fused projections, extra norms, experts), what a
shard computes outside its layers (Gemma's embedding scale, Gemma 2's
softcap), which layers attend to a sliding window, and the library defaults
a config.json may leave out. A family is one entry here and one in each
backend adapter; an architecture without one is refused by name.

Each fact and where it is read: docs/design/models.md#model-families.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.model.recipes import RECIPES

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)

# transformers' defaults that hub configs rely on by leaving the key out.
_QWEN_MAX_WINDOW_LAYERS = 28
_DEFAULT_SLIDING_WINDOW = 4096  # Mistral and Gemma
_GEMMA2_PATTERN = 2  # Gemma 2 alternates: sliding, full, sliding, full, ...
_GEMMA3_PATTERN = 6  # Gemma 3: five sliding layers, then one full one


def _all_full(config: dict[str, Any]) -> list[str]:
    """Llama: every layer attends to the whole past."""
    return [FULL_ATTENTION] * config["num_hidden_layers"]


def _window_everywhere(config: dict[str, Any]) -> list[str]:
    """Mistral, Phi-3, Qwen3-MoE: every layer slides when there is a window
    (transformers then builds the sliding mask for all of them)."""
    kind = SLIDING_ATTENTION if sliding_window(config) else FULL_ATTENTION
    return [kind] * config["num_hidden_layers"]


def _qwen_windows(config: dict[str, Any]) -> list[str]:
    """Qwen2/Qwen3: when there is a window, the layers from
    `max_window_layers` on slide."""
    windowed = sliding_window(config) is not None
    first = config.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS)
    return [
        SLIDING_ATTENTION if windowed and i >= first else FULL_ATTENTION
        for i in range(config["num_hidden_layers"])
    ]


def _every_nth_full(default_pattern: int) -> Callable[[dict[str, Any]], list[str]]:
    """Gemma: layer i is full when (i + 1) is a multiple of the pattern
    (`sliding_window_pattern`), sliding otherwise."""

    def kinds(config: dict[str, Any]) -> list[str]:
        pattern = int(config.get("sliding_window_pattern") or default_pattern)
        return [
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
            for i in range(config["num_hidden_layers"])
        ]

    return kinds


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture's differences from a plain Llama decoder."""

    architecture: str  # config.json's `architectures` entry
    # Per-head RMSNorm of queries and keys (`self_attn.q_norm`, `k_norm`).
    qk_norm: bool = False
    # q/k/v projections always carry a bias and o_proj never does (Qwen2).
    qkv_bias: bool = False
    # The config's `attention_bias` (all four projections) and `mlp_bias`
    # keys apply; families without them never have biases.
    config_biases: bool = False
    # One qkv_proj and one gate_up_proj matrix instead of three and two.
    fused_projections: bool = False
    # Gemma's four norms per layer: the attention output and the MLP
    # output are normed before the residual add, the MLP input as usual.
    feedforward_norms: bool = False
    # RMSNorm scales by (offset + weight): Gemma stores weights around 0
    # and applies 1 + w; the others store them around 1.
    norm_weight_offset: float = 0.0
    # The token embedding is multiplied by sqrt(hidden_size) (Gemma).
    scaled_embedding: bool = False
    # Mixture of experts: per-expert MLPs behind a router (`mlp.gate`),
    # `num_experts` of them in every `decoder_sparse_step`-th layer except
    # `mlp_only_layers`, each `moe_intermediate_size` wide.
    experts: bool = False
    # Which layers slide (when config.json has no `layer_types` list).
    layer_kinds: Callable[[dict[str, Any]], list[str]] = _all_full
    # Qwen: `sliding_window` counts only when `use_sliding_window` is set
    # (transformers ignores the window otherwise; Qwen2.5 configs set one).
    window_switched: bool = False
    # transformers' defaults for keys that change the arithmetic.
    defaults: dict[str, Any] = field(default_factory=dict)


_UNTIED = {"tie_word_embeddings": False}

FAMILIES: dict[str, Family] = {
    family.architecture: family
    for family in (
        Family(
            "Qwen3ForCausalLM",
            qk_norm=True,
            config_biases=True,
            layer_kinds=_qwen_windows,
            window_switched=True,
            defaults=_UNTIED,
        ),
        Family("LlamaForCausalLM", config_biases=True, defaults=_UNTIED),
        Family(
            "Qwen2ForCausalLM",
            qkv_bias=True,
            layer_kinds=_qwen_windows,
            window_switched=True,
            defaults=_UNTIED,
        ),
        Family(
            "MistralForCausalLM",
            layer_kinds=_window_everywhere,
            defaults={**_UNTIED, "sliding_window": _DEFAULT_SLIDING_WINDOW},
        ),
        Family(
            "Gemma2ForCausalLM",
            config_biases=True,
            feedforward_norms=True,
            norm_weight_offset=1.0,
            scaled_embedding=True,
            layer_kinds=_every_nth_full(_GEMMA2_PATTERN),
            defaults={
                "tie_word_embeddings": True,
                "sliding_window": _DEFAULT_SLIDING_WINDOW,
                "query_pre_attn_scalar": 256,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
            },
        ),
        Family(
            "Gemma3ForCausalLM",
            qk_norm=True,
            config_biases=True,
            feedforward_norms=True,
            norm_weight_offset=1.0,
            scaled_embedding=True,
            layer_kinds=_every_nth_full(_GEMMA3_PATTERN),
            defaults={
                "tie_word_embeddings": True,
                "sliding_window": _DEFAULT_SLIDING_WINDOW,
                "query_pre_attn_scalar": 256,
                "attn_logit_softcapping": None,
                "final_logit_softcapping": None,
            },
        ),
        Family(
            "Phi3ForCausalLM",
            fused_projections=True,
            layer_kinds=_window_everywhere,
            defaults={**_UNTIED, "sliding_window": None},
        ),
        Family(
            "Qwen3MoeForCausalLM",
            qk_norm=True,
            config_biases=True,
            experts=True,
            layer_kinds=_window_everywhere,
            window_switched=True,
            defaults={**_UNTIED, "decoder_sparse_step": 1, "mlp_only_layers": []},
        ),
    )
}


def family(config: dict[str, Any]) -> Family:
    """The family of a config read with `weights.read_config` (which has
    already refused architectures without one)."""
    return next(FAMILIES[a] for a in config["architectures"] if a in FAMILIES)


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """FULL_ATTENTION or SLIDING_ATTENTION for every layer: config.json's
    `layer_types` where it lists them (transformers 5 writes them), else the
    family's rule. ValueError for a kind no backend here computes (chunked
    attention, say) or a sliding layer without a window."""
    listed = config.get("layer_types")
    kinds = list(listed) if listed is not None else family(config).layer_kinds(config)
    if len(kinds) != config["num_hidden_layers"]:
        raise ValueError(
            f"layer_types lists {len(kinds)} layers, the model has {config['num_hidden_layers']}"
        )
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (only {', '.join(LAYER_KINDS)})")
    if SLIDING_ATTENTION in kinds and sliding_window(config) is None:
        raise ValueError("sliding_attention layers need a sliding_window")
    return kinds


def sliding_window(config: dict[str, Any]) -> int | None:
    """Tokens a sliding layer sees (itself included), or None. Qwen's
    window counts only with `use_sliding_window`, as in transformers."""
    window = config.get("sliding_window")
    if family(config).window_switched and not config.get("use_sliding_window"):
        return None
    return int(window) if window else None


def embedding_scale(config: dict[str, Any]) -> float | None:
    """What the token embedding is multiplied by before layer 0 (None: 1)."""
    return math.sqrt(config["hidden_size"]) if family(config).scaled_embedding else None


def final_logit_softcap(config: dict[str, Any]) -> float | None:
    """Logits become cap * tanh(logits / cap) when set (Gemma 2)."""
    cap = config.get("final_logit_softcapping")
    return float(cap) if cap else None


def num_experts(config: dict[str, Any]) -> int:
    """Experts per MoE layer: Qwen's `num_experts`, or the name transformers
    5 writes (`num_local_experts`)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def is_sparse_layer(config: dict[str, Any], layer: int) -> bool:
    """Whether `layer` of an MoE model holds experts (else a dense MLP)."""
    return (
        family(config).experts
        and num_experts(config) > 0
        and layer not in config["mlp_only_layers"]
        and (layer + 1) % config["decoder_sparse_step"] == 0
    )


def rope_parameters(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """The rotary parameters layers of `kind` use (`rope_type`, `rope_theta`
    and the scaling type's own keys). transformers 5 nests them under
    `rope_parameters`, per layer kind where kinds differ (Gemma 3: global
    layers at theta 1e6, local ones at 1e4); older configs keep
    `rope_theta`, `rope_scaling` and Gemma 3's `rope_local_base_freq` at
    the top level."""
    nested = config.get("rope_parameters") or {}
    if kind in nested:
        return dict(nested[kind])
    if nested and not any(k in nested for k in LAYER_KINDS):
        return dict(nested)
    params: dict[str, Any] = dict(config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params["rope_theta"] = config.get("rope_theta", 10_000.0)
    if kind == SLIDING_ATTENTION and "rope_local_base_freq" in config:
        params = {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    return params


def recipe_refusal(config: dict[str, Any], backend: str, recipe: str) -> str | None:
    """Why `backend` will not run `recipe` for the model of `config`
    (read_config's), or None; it imports nothing, so a node checks it
    before it joins. torch's q8/q4 quantize the nn.Linear projections, and
    transformers 5 keeps a mixture-of-experts layer's experts as fused 3-D
    parameters, not Linears: q8/q4 would leave most of such a model's
    weights in float32 and call it quantized. They are refused instead (MLX
    quantizes the experts: serve q8/q4 MoE shards there)."""
    quantized = recipe in RECIPES and RECIPES[recipe].bits is not None
    if backend == "torch" and quantized and family(config).experts:
        return (
            f"backend torch does not run recipe {recipe} for {config['architectures'][0]}: "
            "its experts are fused parameters that torch's q8/q4 (which quantize Linear "
            "projections) would leave in float32; use fp32, bf16 or fp16 on torch, "
            "or q8/q4 on mlx"
        )
    return None
