"""The calls into transformers' internals (`runtime.model.backends.torch_adapter`), on CPU.

The adapter's functions are composed by hand into the whole tiny Qwen3 (its
checkpoint's tensors loaded into meta-device layers built one by one, with
per-kind masks and rotary embeddings made as a shard makes them) and must
give transformers' own full model's logits through a prefill and a decode
step on the cache; the rest is checked against the real library too: the
kernels the config is set to, the layer-kind cross-check, the cache slot a
layer writes, strict loading, and the names a fused expert parameter is
made from. Chained shards of every recipe are test_torch_backend.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from runtime.model import architectures
from runtime.model.backends.base import BackendError
from runtime.model.backends.torch_adapter import (
    ATTENTION_IMPLEMENTATION,
    EXPERTS_IMPLEMENTATION,
    FALLBACK_ATTENTION_IMPLEMENTATION,
    attention_masks,
    build_decoder_layer,
    build_norm,
    build_rotary,
    cache_length,
    check_layer_kinds,
    expert_sources,
    load_config,
    load_state,
    new_cache,
    position_embeddings,
    run_layer,
)
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import SINGLE_FILE, read_config

QWEN3 = "Qwen3ForCausalLM"
TOKENS = [11, 200, 37, 5, 98]
NEXT = 3
PARITY_ATOL = 1e-5
"""The same kernels on the same inputs as the full model: exact on CPU, up
to a reduction split differently."""


def prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix): t for name, t in state.items() if name.startswith(prefix)}


class HandBuilt:
    """The whole model from the adapter's parts (what a one-shard torch shard does)."""

    def __init__(self, model_dir: Path) -> None:
        ours = read_config(model_dir)
        self.config = load_config(model_dir, QWEN3)
        self.kinds = architectures.layer_kinds(ours)
        check_layer_kinds(self.config, self.kinds, architectures.sliding_window(ours))
        state = load_file(model_dir / SINGLE_FILE)
        self.embed = state["model.embed_tokens.weight"]
        self.head = state["lm_head.weight"]
        self.layers = []
        for i in range(ours["num_hidden_layers"]):
            layer = build_decoder_layer(self.config, QWEN3, i, i)
            load_state(layer, prefixed(state, f"model.layers.{i}."))
            self.layers.append(layer.eval())
        self.norm = build_norm(self.config, QWEN3)
        load_state(self.norm, prefixed(state, "model.norm."))
        self.rotary = build_rotary(self.config, QWEN3, torch.device("cpu"))

    def forward(self, ids: list[int], cache: Any) -> torch.Tensor:
        past = cache_length(cache)
        hidden = self.embed[torch.tensor(ids)][None]
        position_ids = torch.arange(past, past + len(ids))[None]
        kinds = set(self.kinds)
        masks = attention_masks(self.config, hidden, cache, position_ids, kinds)
        rotary = position_embeddings(self.rotary, QWEN3, hidden, position_ids, kinds)
        for layer, kind in zip(self.layers, self.kinds, strict=True):
            hidden = run_layer(layer, hidden, masks[kind], rotary[kind], position_ids, cache)
        return self.norm(hidden) @ self.head.T


def test_the_parts_composed_compute_transformers_full_model(qwen3_dir: Path) -> None:
    built = HandBuilt(qwen3_dir)
    full = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = full(torch.tensor([[*TOKENS, NEXT]])).logits
        cache = new_cache()
        assert cache_length(cache) == 0
        prefill = built.forward(TOKENS, cache)
        assert cache_length(cache) == len(TOKENS)
        step = built.forward([NEXT], cache)
        assert cache_length(cache) == len(TOKENS) + 1
    assert (prefill - reference[:, : len(TOKENS)]).abs().max() < PARITY_ATOL
    assert (step - reference[:, -1:]).abs().max() < PARITY_ATOL


def test_the_config_is_set_to_the_kernels_from_pretrained_picks(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    config = load_config(qwen3_dir, QWEN3)
    assert config._attn_implementation == ATTENTION_IMPLEMENTATION == "sdpa"
    assert config._experts_implementation == EXPERTS_IMPLEMENTATION
    gemma2 = make_tiny_model(tmp_path / "gemma2", layers=2, family="gemma2", with_manifest=False)
    # SDPA has no attention-logit softcapping: Gemma 2 runs eager, as in from_pretrained.
    fallback = load_config(gemma2, "Gemma2ForCausalLM")._attn_implementation
    assert fallback == FALLBACK_ATTENTION_IMPLEMENTATION == "eager"


def test_layer_kinds_that_drift_from_transformers_are_refused(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    config = load_config(qwen3_dir, QWEN3)
    kinds = architectures.layer_kinds(read_config(qwen3_dir))
    check_layer_kinds(config, kinds, None)
    with pytest.raises(BackendError, match="reads layer kinds"):
        check_layer_kinds(config, ["sliding_attention", *kinds[1:]], 4)
    mistral = make_tiny_model(tmp_path / "m", layers=2, family="mistral", with_manifest=False)
    ours = read_config(mistral)
    theirs = load_config(mistral, "MistralForCausalLM")
    window = architectures.sliding_window(ours)
    assert window is not None
    check_layer_kinds(theirs, architectures.layer_kinds(ours), window)
    with pytest.raises(BackendError, match=r"\(window \[" + str(window) + r"\]\)"):
        check_layer_kinds(theirs, architectures.layer_kinds(ours), window + 1)


def test_a_layer_is_built_on_meta_writing_its_own_cache_slot(qwen3_dir: Path) -> None:
    config = load_config(qwen3_dir, QWEN3)
    layer = build_decoder_layer(config, QWEN3, layer_idx=5, cache_idx=1)
    attention: Any = layer.self_attn
    assert attention.layer_idx == 1
    assert {p.device.type for p in layer.parameters()} == {"meta"}
    assert {p.device.type for p in build_norm(config, QWEN3).parameters()} == {"meta"}
    rotary = build_rotary(config, QWEN3, torch.device("cpu"))
    assert not list(rotary.parameters()) and rotary.inv_freq.device.type == "cpu"


def test_loading_is_strict(qwen3_dir: Path) -> None:
    config = load_config(qwen3_dir, QWEN3)
    state = prefixed(load_file(qwen3_dir / SINGLE_FILE), "model.layers.0.")
    layer = build_decoder_layer(config, QWEN3, 0, 0)
    with pytest.raises(RuntimeError, match="Missing key"):
        load_state(layer, {k: v for k, v in state.items() if "q_proj" not in k})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_state(layer, {**state, "extra.weight": torch.zeros(1)})
    norm = nn.LayerNorm(2, device="meta")
    load_state(norm, {"weight": torch.ones(2), "bias": torch.zeros(2)})
    assert norm.weight.device.type == "cpu"  # assigned, not copied into meta


def test_fused_expert_parameters_name_their_per_expert_sources() -> None:
    assert expert_sources("mlp.experts.gate_up_proj", 2) == [
        ["mlp.experts.0.gate_proj.weight", "mlp.experts.0.up_proj.weight"],
        ["mlp.experts.1.gate_proj.weight", "mlp.experts.1.up_proj.weight"],
    ]
    assert expert_sources("mlp.experts.down_proj", 3) == [
        [f"mlp.experts.{e}.down_proj.weight"] for e in range(3)
    ]
    assert expert_sources("self_attn.q_proj.weight", 2) is None
    assert expert_sources("mlp.gate.weight", 2) is None
