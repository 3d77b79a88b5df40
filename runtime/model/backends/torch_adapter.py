"""Every call the torch backend makes into transformers' internals.

transformers' layer-level API is not a public contract: between minor
releases the decoder layer's cache keyword was renamed (`past_key_value` →
`past_key_values` → `cache` in 5.x), `create_causal_mask` changed its
arguments, and rotary embeddings moved from the attention module to the
model. The backend therefore never touches transformers directly; it calls
the functions below, which are written against the range pinned in
pyproject.toml's `runtime` extra (transformers 5.24) and which
tests/test_runtime_torch.py checks against the full model. When transformers
is upgraded, this is the one file to re-read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, DynamicCache, PretrainedConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

# Per architecture: (decoder layer class, RMSNorm class, rotary embedding class).
_CLASSES = {
    "Qwen3ForCausalLM": (
        modeling_qwen3.Qwen3DecoderLayer,
        modeling_qwen3.Qwen3RMSNorm,
        modeling_qwen3.Qwen3RotaryEmbedding,
    ),
    "LlamaForCausalLM": (
        modeling_llama.LlamaDecoderLayer,
        modeling_llama.LlamaRMSNorm,
        modeling_llama.LlamaRotaryEmbedding,
    ),
}

# The attention kernel. SDPA is what `from_pretrained` picks by default on
# every device, so a shard computes exactly what the full model computes.
ATTENTION_IMPLEMENTATION = "sdpa"

TRANSFORMERS_VERSION = transformers.__version__


def load_config(model_dir: Path) -> PretrainedConfig:
    """The model's transformers config, set to the attention kernel we use."""
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    return config


def build_decoder_layer(
    config: PretrainedConfig, architecture: str, layer_idx: int, cache_idx: int
) -> nn.Module:
    """One decoder layer with parameters on the meta device (no memory until
    `load_state` assigns the real tensors). `layer_idx` is the layer's place
    in the whole model (it selects per-layer settings such as the attention
    type); `cache_idx` is its slot in the shard's own KV cache, so a shard
    [a, b) keeps b-a cache slots, not b."""
    layer_cls = _CLASSES[architecture][0]
    with torch.device("meta"):
        layer = layer_cls(config, layer_idx)
    layer.self_attn.layer_idx = cache_idx
    return layer


def build_norm(config: PretrainedConfig, architecture: str) -> nn.Module:
    """The final RMSNorm, on the meta device."""
    norm_cls = _CLASSES[architecture][1]
    with torch.device("meta"):
        return norm_cls(config.hidden_size, eps=config.rms_norm_eps)


def build_rotary(config: PretrainedConfig, architecture: str, device: torch.device) -> nn.Module:
    """The rotary embedding (a buffer of inverse frequencies, no weights)."""
    return _CLASSES[architecture][2](config=config).to(device)


def load_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give a meta-device module its real tensors (strict: every parameter
    must be supplied and nothing else)."""
    module.load_state_dict(state, strict=True, assign=True)


def new_cache() -> Any:
    """An empty KV cache; its layers are created as the shard's layers fill them."""
    return DynamicCache()


def cache_length(cache: Any) -> int:
    """Tokens already in the cache."""
    return int(cache.get_seq_length())


def causal_mask(
    config: PretrainedConfig, hidden: torch.Tensor, cache: Any, position_ids: torch.Tensor
) -> Any:
    """The attention mask for `hidden` [1, T, H] following what `cache`
    holds; must be made before the layers append this step's keys. May be
    None, meaning "plain causal" to the SDPA kernel."""
    return create_causal_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=None,
        cache=cache,
        position_ids=position_ids,
    )


def run_layer(
    layer: nn.Module,
    hidden: torch.Tensor,
    mask: Any,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    position_ids: torch.Tensor,
    cache: Any,
) -> torch.Tensor:
    """One decoder layer forward, appending its keys and values to `cache`."""
    return layer(
        hidden,
        attention_mask=mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        position_embeddings=position_embeddings,
    )
