"""Every call the torch backend makes into transformers' internals.

transformers' layer-level API is not a public contract: between minor
releases the decoder layer's cache keyword was renamed (`past_key_value` →
`past_key_values` → `cache` in 5.x), `create_causal_mask` changed its
arguments, and rotary embeddings moved from the attention module to the
model. The backend therefore never touches transformers directly; it calls
the functions below, which are written against the range pinned in
pyproject.toml's `runtime` extra (transformers 5.24) and which
tests/runtime/model/backends/test_torch_backend.py and
tests/runtime/model/test_architectures.py check against the full model,
family by family. When transformers is upgraded, this is the one file to
re-read.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, DynamicCache, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from runtime.model.architectures import FULL_ATTENTION, SLIDING_ATTENTION
from runtime.model.backends import IMPORT_LOCK
from runtime.model.backends.base import BackendError


@dataclass(frozen=True, slots=True)
class _Classes:
    """transformers' classes for one architecture (runtime/model/
    architectures.py lists what else differs between families)."""

    # Decoder layer, built as layer(config, layer_idx); Any, since the shard
    # sets its attention's `layer_idx`, which nn.Module does not declare.
    layer: Callable[..., Any]
    norm: type[nn.Module]  # final RMSNorm, built as norm(hidden_size, eps)
    rotary: type[nn.Module]  # rotary embedding, built as rotary(config=config)
    # The rotary embedding takes the layer kind and returns that kind's
    # cos/sin (Gemma 3: local layers at one base, global ones at another).
    rotary_per_kind: bool = False


_CLASSES = {
    "Qwen3ForCausalLM": _Classes(
        modeling_qwen3.Qwen3DecoderLayer,
        modeling_qwen3.Qwen3RMSNorm,
        modeling_qwen3.Qwen3RotaryEmbedding,
    ),
    "LlamaForCausalLM": _Classes(
        modeling_llama.LlamaDecoderLayer,
        modeling_llama.LlamaRMSNorm,
        modeling_llama.LlamaRotaryEmbedding,
    ),
    "Qwen2ForCausalLM": _Classes(
        modeling_qwen2.Qwen2DecoderLayer,
        modeling_qwen2.Qwen2RMSNorm,
        modeling_qwen2.Qwen2RotaryEmbedding,
    ),
    "MistralForCausalLM": _Classes(
        modeling_mistral.MistralDecoderLayer,
        modeling_mistral.MistralRMSNorm,
        modeling_mistral.MistralRotaryEmbedding,
    ),
    "Gemma2ForCausalLM": _Classes(
        modeling_gemma2.Gemma2DecoderLayer,
        modeling_gemma2.Gemma2RMSNorm,
        modeling_gemma2.Gemma2RotaryEmbedding,
    ),
    "Gemma3ForCausalLM": _Classes(
        modeling_gemma3.Gemma3DecoderLayer,
        modeling_gemma3.Gemma3RMSNorm,
        modeling_gemma3.Gemma3RotaryEmbedding,
        rotary_per_kind=True,
    ),
    "Phi3ForCausalLM": _Classes(
        modeling_phi3.Phi3DecoderLayer,
        modeling_phi3.Phi3RMSNorm,
        modeling_phi3.Phi3RotaryEmbedding,
    ),
    "Qwen3MoeForCausalLM": _Classes(
        modeling_qwen3_moe.Qwen3MoeDecoderLayer,
        modeling_qwen3_moe.Qwen3MoeRMSNorm,
        modeling_qwen3_moe.Qwen3MoeRotaryEmbedding,
    ),
}

# The attention kernel: SDPA, which `from_pretrained` picks by default on
# every device, so a shard computes exactly what the full model computes;
# eager for a family whose model class cannot take SDPA (Gemma 2: SDPA has
# no attention-logit softcapping), as `from_pretrained` falls back to.
ATTENTION_IMPLEMENTATION = "sdpa"
FALLBACK_ATTENTION_IMPLEMENTATION = "eager"
# The experts kernel of a mixture-of-experts layer, again `from_pretrained`'s
# default (one grouped matmul over the experts a batch routes to).
EXPERTS_IMPLEMENTATION = "grouped_mm"

# transformers 5 keeps each MoE layer's experts as two fused parameters,
# where checkpoints hold one matrix per expert and projection: parameter
# name -> the per-expert tensors whose rows it concatenates, expert by
# expert (gate before up, as the experts' forward splits it).
_FUSED_EXPERTS = {
    "mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.experts.down_proj": ("down_proj",),
}

TRANSFORMERS_VERSION = transformers.__version__


def load_config(model_dir: Path, architecture: str) -> PretrainedConfig:
    """The model's transformers config, set to the kernels we use. Under
    IMPORT_LOCK: the config class and the model class are resolved through
    transformers' lazy module, which another thread (a chat entry loading
    its tokenizer) may be resolving at the same time."""
    with IMPORT_LOCK:
        config = _read_config(model_dir)
        supports_sdpa = getattr(transformers, architecture)._supports_sdpa
    config._attn_implementation = (
        ATTENTION_IMPLEMENTATION if supports_sdpa else FALLBACK_ATTENTION_IMPLEMENTATION
    )
    config._experts_implementation = EXPERTS_IMPLEMENTATION
    return config


CONFIG_CACHE_SIZE = 16
"""Model folders whose parsed config is kept: a doctor or a calibration
loads one layer at a time, and transformers' parse took 40 ms of each of
a calibration's 180 loads (8 of its 50 CPU-seconds)."""


def _read_config(model_dir: Path) -> PretrainedConfig:
    """AutoConfig's parse of the folder's config.json, a fresh copy (the
    caller sets fields on it), parsed again whenever the file changes."""
    try:
        stat = (Path(model_dir) / "config.json").stat()
    except OSError:  # transformers says what is missing
        return AutoConfig.from_pretrained(model_dir)
    parsed = _parsed_config(str(model_dir), stat.st_mtime_ns, stat.st_size)
    return copy.deepcopy(parsed)


@functools.lru_cache(maxsize=CONFIG_CACHE_SIZE)
def _parsed_config(model_dir: str, mtime_ns: int, size: int) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_dir)


def check_layer_kinds(config: PretrainedConfig, kinds: list[str], window: int | None) -> None:
    """BackendError unless transformers reads the same attention kind (and
    window) for every layer as runtime.model.architectures does from
    config.json: the masks are made from ours, the cache and the full model
    from theirs, and they must not drift apart."""
    theirs, per_layer = get_layer_types_and_kwargs(config)
    windows = {int(kw["sliding_window"]) for kw in per_layer if kw.get("sliding_window")}
    if list(theirs) != kinds or windows - {window}:
        raise BackendError(
            f"transformers {TRANSFORMERS_VERSION} reads layer kinds {list(theirs)} "
            f"(window {sorted(windows)}) from this config, shardmesh reads {kinds} "
            f"(window {window})"
        )


def build_decoder_layer(
    config: PretrainedConfig, architecture: str, layer_idx: int, cache_idx: int
) -> nn.Module:
    """One decoder layer with parameters on the meta device (no memory until
    `load_state` assigns the real tensors). `layer_idx` is the layer's place
    in the whole model (it selects per-layer settings such as the attention
    type and whether an MoE layer has experts); `cache_idx` is its slot in
    the shard's own KV cache, so a shard [a, b) keeps b-a cache slots, not b."""
    with torch.device("meta"):
        layer = _CLASSES[architecture].layer(config, layer_idx)
    layer.self_attn.layer_idx = cache_idx
    return layer


def build_norm(config: PretrainedConfig, architecture: str) -> nn.Module:
    """The final RMSNorm, on the meta device."""
    with torch.device("meta"):
        return _CLASSES[architecture].norm(config.hidden_size, eps=config.rms_norm_eps)


def build_rotary(config: PretrainedConfig, architecture: str, device: torch.device) -> nn.Module:
    """The rotary embedding (buffers of inverse frequencies, no weights)."""
    return _CLASSES[architecture].rotary(config=config).to(device)


def expert_sources(name: str, experts: int) -> list[list[str]] | None:
    """For a decoder layer's parameter `name` that fuses per-expert
    checkpoint tensors: per expert, the tensors (relative to the layer)
    whose rows it concatenates; the parameter is those blocks stacked along
    a new first dimension. None for a parameter stored as it is."""
    projections = _FUSED_EXPERTS.get(name)
    if projections is None:
        return None
    return [[f"mlp.experts.{e}.{proj}.weight" for proj in projections] for e in range(experts)]


def load_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give a meta-device module its real tensors (strict: every parameter
    must be supplied and nothing else)."""
    module.load_state_dict(state, strict=True, assign=True)


def new_cache() -> Any:
    """An empty KV cache; its layers are created as the shard's layers fill
    them. Every slot keeps all its keys, sliding layers included: the
    sliding mask hides the ones outside the window."""
    return DynamicCache()


def cache_length(cache: Any) -> int:
    """Tokens already in the cache."""
    return int(cache.get_seq_length())


def position_embeddings(
    rotary: nn.Module,
    architecture: str,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    kinds: set[str],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin for `position_ids`, per layer kind in `kinds` (one shared
    pair unless the family rotates each kind at its own base)."""
    if _CLASSES[architecture].rotary_per_kind:
        return {kind: rotary(hidden, position_ids, kind) for kind in kinds}
    shared = rotary(hidden, position_ids)
    return dict.fromkeys(kinds, shared)


def attention_masks(
    config: PretrainedConfig,
    hidden: torch.Tensor,
    cache: Any,
    position_ids: torch.Tensor,
    kinds: set[str],
) -> dict[str, Any]:
    """The attention mask per layer kind in `kinds` for `hidden` [1, T, H]
    following what `cache` holds; must be made before the layers append
    this step's keys. A mask may be None, meaning "plain causal" to SDPA."""
    makers = {
        FULL_ATTENTION: create_causal_mask,
        SLIDING_ATTENTION: create_sliding_window_causal_mask,
    }
    return {
        kind: makers[kind](
            config=config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=cache,
            position_ids=position_ids,
        )
        for kind in kinds
    }


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


class BatchCache:
    """One batched step's view of several sessions' caches, passed to the
    decoder layers in place of one session's cache (they call only
    `update`). Each layer's update appends row r's first `counts[r]` new
    keys and values (not its padding) to session r's own DynamicCache, then
    hands attention every row's keys right-padded with zeros to
    `key_slots` (batching.BatchLayout): the sessions stay independent
    caches, at the price of one padded copy of their keys per layer and
    step."""

    def __init__(self, sessions: list[Any], counts: tuple[int, ...], key_slots: int) -> None:
        self.sessions = sessions
        self.counts = counts
        self.key_slots = key_slots

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [
            session.update(keys[r : r + 1, :, :count], values[r : r + 1, :, :count], layer_idx)
            for r, (session, count) in enumerate(zip(self.sessions, self.counts, strict=True))
        ]
        keys = right_padded([k for k, _ in rows], self.key_slots)
        return keys, right_padded([v for _, v in rows], self.key_slots)


def right_padded(rows: list[torch.Tensor], slots: int) -> torch.Tensor:
    """[1, heads, L_r, dim] per row -> [rows, heads, slots, dim], zeros after
    each row's own."""
    _, heads, _, dim = rows[0].shape
    out = rows[0].new_zeros(len(rows), heads, slots, dim)
    for r, row in enumerate(rows):
        out[r, :, : row.shape[2]] = row[0]
    return out


def cached_keys(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A session's keys and values [1, heads, L, dim], per cache slot."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def batch_mask(config: PretrainedConfig, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A batched step's mask [rows, 1, T, keys] from `visible` (True where
    a query may attend) in the form the layers' attention kernel takes:
    boolean for SDPA, additive (0 or the dtype's minimum, as transformers'
    own eager masks) for the eager kernel, which adds it to the scores."""
    if config._attn_implementation == FALLBACK_ATTENTION_IMPLEMENTATION:
        blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=visible.device)
        return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), blocked)
    return visible
