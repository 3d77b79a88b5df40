"""Every architecture shardmesh serves computes what transformers computes.

Each model here is made by transformers itself — its own config class, its
own model class, `save_pretrained` — so the checkpoint layout, the config
keys and the numerics the shards are held to are the library's, not ours.
Weights are re-drawn at a scale where every layer moves the residual stream
(transformers' initialisation leaves the layers near identities, where a
wrong mask or a missing norm could hide). Per architecture:

- shards [0,1), [1,3), [3,4), chained with one KV cache each, reproduce the
  full model's logits through a 6-token prefill, a 2-token chunk on top of
  the cache and three single-token steps, on torch (fp32: exact up to
  reduction order) and on MLX (within 1e-4);
- with a sliding window of 4 tokens the sequence outgrows the window, and
  the test shows the window changes the output (so a wrong mask would fail);
- the doctor admits, from the model's own manifest, fp32 on both backends
  and every other recipe on MLX (but what is refused for an MoE model).

Then what is refused: q8/q4 of an MoE model on torch (fused experts are no
Linears; MLX quantizes them), an architecture without a family (by name),
a setting mlx-lm's classes would compute otherwise than transformers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from runtime.cli.commands.tiny_model import TINY_FAMILIES
from runtime.model import architectures
from runtime.model.backends import ShardSpec, load_shard
from runtime.model.backends.base import BackendError, ShardBackend
from runtime.model.backends.torch_backend import load_torch_shard
from runtime.model.doctor import run_doctor
from runtime.model.manifest import build_manifest, load_golden, load_manifest
from runtime.model.recipes import RECIPES
from runtime.model.tiny import FAMILIES as TINY_MODEL_FAMILIES
from runtime.model.tiny import make_tiny_model, write_tokenizer
from runtime.model.weights import ShardLoadError, read_config

LAYERS = 4
SPANS = ((0, 1), (1, 3), (3, 4))
# A 6-token prefill, a 2-token chunk on top of the cache, three decode steps:
# 11 tokens, well past the sliding window.
STEPS = ((0, 6), (6, 8), (8, 9), (9, 10), (10, 11))
TOKENS = np.array([11, 200, 37, 5, 98, 143, 7, 64, 250, 3, 301], dtype=np.int64)
WINDOW = 4
# fp32 parity: torch runs transformers' own kernels on the same inputs
# (measured: 0); MLX runs its own kernels (measured: <= 1.5e-5 on Gemma 3's
# logits of up to ~70, whose tied head is the unit-variance embedding;
# <= 1e-6 where logits stay within ~2).
TORCH_ATOL = 1e-5
MLX_ATOL = 1e-4
# The sliding window must move the logits by far more than either bound.
WINDOW_EFFECT = 1e-2

# Weight scales: projections std GAIN/sqrt(fan_in) (as runtime/model/tiny.py
# draws them), norms N(0, NORM_JITTER) off their initial value, biases
# N(0, BIAS_STD), embeddings N(0, 1).
SEED = 0
GAIN = 0.5
NORM_JITTER = 0.1
BIAS_STD = 0.1

_GEOMETRY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}

# Architecture -> its tiny config, from transformers' own config class, given
# the vocabulary size. Each exercises what sets its family apart.
CONFIGS: dict[str, Callable[[int], PretrainedConfig]] = {
    # Llama 3.1's rotary scaling; a short original context makes the scaled
    # frequencies ones an 11-token sequence turns through.
    "LlamaForCausalLM": lambda vocab: transformers.LlamaConfig(
        **_GEOMETRY,
        vocab_size=vocab,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "Qwen2ForCausalLM": lambda vocab: transformers.Qwen2Config(**_GEOMETRY, vocab_size=vocab),
    "MistralForCausalLM": lambda vocab: transformers.MistralConfig(
        **_GEOMETRY, vocab_size=vocab, sliding_window=WINDOW
    ),
    # Alternating sliding/full layers, both softcaps, tied embeddings.
    "Gemma2ForCausalLM": lambda vocab: transformers.Gemma2Config(
        **_GEOMETRY, vocab_size=vocab, sliding_window=WINDOW, query_pre_attn_scalar=16
    ),
    # Local and global layers with their own rotary (global ones scaled, as
    # in Gemma 3 4B and up), q/k norms, tied embeddings.
    "Gemma3ForCausalLM": lambda vocab: transformers.Gemma3TextConfig(
        **_GEOMETRY,
        vocab_size=vocab,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
    # Fused projections, a window, rotary over part of each head (half here;
    # Phi-4-mini rotates three quarters).
    "Phi3ForCausalLM": lambda vocab: transformers.Phi3Config(
        **{k: v for k, v in _GEOMETRY.items() if k != "head_dim"},
        vocab_size=vocab,
        sliding_window=WINDOW,
        pad_token_id=0,
        eos_token_id=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
    "Qwen3MoeForCausalLM": lambda vocab: transformers.Qwen3MoeConfig(
        **_GEOMETRY,
        vocab_size=vocab,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
}
ARCHITECTURES = list(CONFIGS)
SLIDING = ["MistralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"]
MOE = "Qwen3MoeForCausalLM"
# Phi-3-128k's rotary scaling (one factor per rotated pair of a 16-wide
# head), which mlx-lm computes otherwise than transformers.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10_000.0,
    "short_factor": [1.0] * 8,
    "long_factor": [4.0] * 8,
}


class Model:
    """One architecture's directory, and transformers' model of it in memory."""

    def __init__(self, folder: Path, hf: transformers.PreTrainedModel) -> None:
        self.dir = folder
        self.hf = hf
        self._manifest = False

    def with_manifest(self) -> Path:
        """The directory, its manifest built on first use (the doctor's)."""
        if not self._manifest:
            build_manifest(self.dir)
            self._manifest = True
        return self.dir


def _randomize(model: transformers.PreTrainedModel) -> None:
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:  # around transformers' init: 1, or 0 where applied as 1 + w
                param.add_(NORM_JITTER * noise)
            elif name.endswith("bias"):
                param.copy_(BIAS_STD * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(GAIN / param.shape[-1] ** 0.5 * noise)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Model]:
    """Builds each architecture's model once, when a test first asks."""
    built: dict[str, Model] = {}

    def get(arch: str) -> Model:
        if arch not in built:
            folder = tmp_path_factory.mktemp(arch)
            vocab = write_tokenizer(folder)
            torch.manual_seed(SEED)
            hf = AutoModelForCausalLM.from_config(CONFIGS[arch](vocab)).eval()
            _randomize(hf)
            hf.save_pretrained(folder, safe_serialization=True)
            built[arch] = Model(folder, hf)
        return built[arch]

    return get


def _reference(hf: transformers.PreTrainedModel, tokens: np.ndarray = TOKENS) -> np.ndarray:
    """The full model's logits over STEPS, with its own cache as in generation."""
    cache = DynamicCache(config=hf.config)
    logits = []
    with torch.no_grad():
        for lo, hi in STEPS:
            ids = torch.from_numpy(tokens[lo:hi])[None]
            logits.append(hf(ids, cache=cache, use_cache=True).logits[0].numpy())
    return np.concatenate(logits)


def _chain(shards: Sequence[ShardBackend]) -> np.ndarray:
    """The shards' logits over STEPS, one cache per shard, as a session runs."""
    caches = [shard.new_cache() for shard in shards]
    logits = []
    for lo, hi in STEPS:
        x: np.ndarray = TOKENS[lo:hi]
        for shard, cache in zip(shards, caches, strict=True):
            x = shard.forward(x, np.arange(lo, hi), cache)
        logits.append(x)
    return np.concatenate(logits)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.abs(a.astype(np.float64) - b).max())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_torch_shards_match_transformers(models: Callable[[str], Model], arch: str) -> None:
    model = models(arch)
    shards = [load_shard(ShardSpec(model.dir, a, b, "fp32"), "torch") for a, b in SPANS]
    assert _max_abs(_chain(shards), _reference(model.hf)) <= TORCH_ATOL


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mlx_shards_match_transformers(models: Callable[[str], Model], arch: str) -> None:
    model = models(arch)
    shards = [load_shard(ShardSpec(model.dir, a, b, "fp32"), "mlx") for a, b in SPANS]
    assert _max_abs(_chain(shards), _reference(model.hf)) <= MLX_ATOL


@pytest.mark.parametrize("arch", SLIDING)
def test_the_sliding_window_matters(models: Callable[[str], Model], arch: str) -> None:
    """The same weights with a window longer than the sequence give other
    logits, so the parity tests above hold each shard to its real mask."""
    model = models(arch)
    config = CONFIGS[arch](model.hf.config.vocab_size)
    config.sliding_window = len(TOKENS) + 1
    unwindowed = AutoModelForCausalLM.from_config(config).eval()
    unwindowed.load_state_dict(model.hf.state_dict())
    assert _max_abs(_reference(unwindowed), _reference(model.hf)) > WINDOW_EFFECT
    assert architectures.SLIDING_ATTENTION in architectures.layer_kinds(read_config(model.dir))


def _mlx_refuses(arch: str, recipe: str) -> bool:
    """Whether MLX here refuses `recipe` for `arch`: an MoE model's bf16 and
    fp16 on MLX's CPU build, whose expert matmul runs float32 only."""
    import mlx.core as mx

    on_cpu = mx.default_device().type.name == "cpu"
    return arch == MOE and on_cpu and RECIPES[recipe].dtype != "float32"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_doctor_admits_fp32_on_torch(models: Callable[[str], Model], arch: str) -> None:
    """From the model's own manifest, on the whole model and a middle span.
    (torch's other recipes are the calibration's reference: building the
    manifest has loaded and run every span of each of them.)"""
    model_dir = models(arch).with_manifest()
    for start, end in ((0, LAYERS), (1, 3)):
        report = run_doctor(model_dir, start, end, "fp32", "torch", measure=False)
        assert report.admitted, report.to_json()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_doctor_admits_every_recipe_on_mlx(models: Callable[[str], Model], arch: str) -> None:
    """fp32 on the whole model and a middle span, every other recipe on the
    middle span, each held to the manifest's calibration (torch's): q8/q4
    with Qwen2's biases, Phi-3's fused projections, Gemma's norms, an MoE
    model's quantized experts."""
    model_dir = models(arch).with_manifest()
    for recipe in RECIPES:
        for start, end in ((0, LAYERS), (1, 3)) if recipe == "fp32" else ((1, 3),):
            report = run_doctor(model_dir, start, end, recipe, "mlx", measure=False)
            if _mlx_refuses(arch, recipe):
                assert (report.admitted, report.reason) == (False, "load_failed"), recipe
            else:
                assert report.admitted, report.to_json()


# --- what is refused, and the MoE recipes -----------------------------------------


def test_moe_quantization(models: Callable[[str], Model]) -> None:
    """torch's q8/q4 quantize Linear projections; transformers keeps the
    experts as fused parameters, so a torch q8 MoE shard would hold most of
    its weights in float32. torch refuses it, saying why (and the manifest
    calibrates only the float recipes); MLX quantizes the experts too."""
    model_dir = models(MOE).with_manifest()
    for recipe in ("q8", "q4"):
        with pytest.raises(
            BackendError, match=f"does not run recipe {recipe} for {MOE}: its experts"
        ):
            load_torch_shard(ShardSpec(model_dir, 1, 3, recipe), "cpu")
        # The doctor says so at its recipe check, before it loads anything,
        # as a node's check before joining does (tests/runtime/node/test_preflight.py).
        refused = run_doctor(model_dir, 1, 3, recipe, "torch", measure=False)
        assert (refused.admitted, refused.reason) == (False, "recipe_unsupported")
    calibrated = load_golden(model_dir, load_manifest(model_dir)).calibration
    assert sorted(calibrated) == sorted(r for r in RECIPES if RECIPES[r].bits is None)
    fp32 = load_shard(ShardSpec(model_dir, 1, 3, "fp32"), "mlx").info()["weight_bytes"]
    q8 = load_shard(ShardSpec(model_dir, 1, 3, "q8"), "mlx").info()["weight_bytes"]
    assert q8 < 0.35 * fp32  # ~9/32 of fp32: the experts are quantized too


def test_unsupported_architecture_is_refused_by_name(
    models: Callable[[str], Model], tmp_path: Path
) -> None:
    model_dir = shutil.copytree(models("Qwen2ForCausalLM").dir, tmp_path / "gpt2")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    refusal = r"unsupported architecture \['GPT2LMHeadModel'\]; supported: .*Gemma3ForCausalLM"
    with pytest.raises(ShardLoadError, match=refusal):
        read_config(model_dir)
    for backend in ("torch", "mlx"):
        with pytest.raises(BackendError, match=refusal):
            load_shard(ShardSpec(model_dir, 0, 1, "fp32"), backend)


@pytest.mark.parametrize(
    ("arch", "edit", "refusal"),
    [
        ("Gemma2ForCausalLM", {"attn_logit_softcapping": None}, "mlx-lm's gemma2 always softcaps"),
        (
            "Phi3ForCausalLM",
            {"rope_parameters": LONGROPE},
            "does not run rotary scaling 'longrope'",
        ),
    ],
)
def test_mlx_refuses_what_mlx_lm_cannot_compute(
    models: Callable[[str], Model], arch: str, edit: dict[str, object], refusal: str
) -> None:
    """A setting mlx-lm's classes would compute otherwise than transformers
    is refused on MLX by name, not served wrong; torch still loads it."""
    model_dir = models(arch).dir
    config_path = model_dir / "config.json"
    original = config_path.read_text()
    try:
        config_path.write_text(json.dumps({**json.loads(original), **edit}))
        with pytest.raises(BackendError, match=refusal):
            load_shard(ShardSpec(model_dir, 0, 1, "fp32"), "mlx")
        load_shard(ShardSpec(model_dir, 0, 1, "fp32"), "torch")
    finally:
        config_path.write_text(original)


# --- reading configs as transformers does ------------------------------------------


@pytest.mark.parametrize(
    ("arch", "keys"),
    [
        ("Gemma2ForCausalLM", {"sliding_window": 8}),
        ("Gemma3ForCausalLM", {"sliding_window": 8, "sliding_window_pattern": 3}),
        ("Gemma3ForCausalLM", {}),
        (
            "Qwen2ForCausalLM",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 5},
        ),
        ("Qwen2ForCausalLM", {"sliding_window": 8}),
        (
            "Qwen3MoeForCausalLM",
            {"use_sliding_window": True, "sliding_window": 8, "num_experts": 2},
        ),
        ("MistralForCausalLM", {}),
        ("MistralForCausalLM", {"sliding_window": None}),
        ("Phi3ForCausalLM", {"sliding_window": 8}),
        ("LlamaForCausalLM", {}),
    ],
)
def test_layer_kinds_agree_with_transformers(
    arch: str, keys: dict[str, object], tmp_path: Path
) -> None:
    """A hub config.json without `layer_types` (written before transformers
    5): shardmesh derives which layers slide as transformers does."""
    raw = {
        "architectures": [arch],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 7,
        "vocab_size": 512,
        **keys,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = read_config(tmp_path)
    hf_config = getattr(transformers, arch).config_class(
        **{k: v for k, v in raw.items() if k != "architectures"}
    )
    kinds, per_layer = get_layer_types_and_kwargs(hf_config)
    assert architectures.layer_kinds(config) == list(kinds)
    windows = {kw["sliding_window"] for kw in per_layer if "sliding_window" in kw}
    assert windows == ({architectures.sliding_window(config)} if windows else set())


# --- the tiny models -----------------------------------------------------------------


@pytest.mark.parametrize("family", list(TINY_MODEL_FAMILIES))
def test_tiny_model_of_every_family(family: str, tmp_path: Path) -> None:
    """`shardmesh tiny-model --family F` writes what transformers loads with
    no tensor missing or left over, and the whole-model shard computes it."""
    model_dir = make_tiny_model(tmp_path / family, layers=3, family=family, with_manifest=False)
    hf, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        reference = hf.eval()(torch.from_numpy(TOKENS)[None]).logits[0].numpy()
    shard = load_torch_shard(ShardSpec(model_dir, 0, 3, "fp32"), "cpu")
    logits = shard.forward(TOKENS, np.arange(len(TOKENS)), shard.new_cache())
    assert _max_abs(logits, reference) <= TORCH_ATOL


def test_cli_offers_every_tiny_family() -> None:
    assert tuple(TINY_MODEL_FAMILIES) == TINY_FAMILIES
