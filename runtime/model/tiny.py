"""A tiny random model with a real tokenizer: the swarm's test and demo model.

Tests, the demo and the benchmarks need a model that exercises every real
code path — Hugging Face config, safetensors weights (single-file or
index-sharded), a `tokenizers` tokenizer with special tokens, a ChatML chat
template, a manifest with golden activations — yet loads in milliseconds and
needs no download. Weights are random but *deterministic*: the same seed
gives byte-identical files, so a manifest digest computed on one machine
names the same model on another.

Weights are drawn with NumPy's seeded generator (not transformers' init),
so the files depend only on this module: the shapes come from
`safetensors_shard.expected_shapes`, the same table loading checks against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from runtime.model import architectures
from runtime.model.progress import Progress
from runtime.model.weights import INDEX_FILE, SINGLE_FILE, expected_shapes

# Model geometry: small enough that an 8-layer model runs a forward in
# milliseconds on one CPU core, big enough to exercise grouped-query
# attention (4 query heads share 2 KV heads) and a SwiGLU MLP wider than the
# residual stream.
HIDDEN_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE_SIZE = 128
LARGE_HEAD_DIM = 64  # head size of wider benchmark models, as in real ones
MAX_POSITIONS = 2048
ROPE_THETA = 10_000.0
RMS_NORM_EPS = 1e-6

# Initialisation. Projections get std GAIN/sqrt(fan_in): with GAIN 1 each
# layer changes the residual stream by about as much as it already holds,
# so the output depends on context and on every layer (with transformers'
# default std 0.02 the layers are near-identities, greedy decoding just
# echoes a token, and a wrong layer would go unnoticed). Norm weights are
# jittered around 1 so a swapped or missing norm is visible too.
PROJECTION_GAIN = 0.5
EMBEDDING_STD = 1.0
NORM_JITTER = 0.1

# Tokenizer. A byte-level BPE (as Qwen and Llama 3 use) trained on the fixed
# text below: the 256 byte symbols guarantee any string encodes, and the
# merges give real multi-byte tokens. Training on a fixed corpus with fixed
# settings is deterministic.
TOKENIZER_VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CORPUS = (
    "The swarm serves a language model across many small machines. Each node "
    "holds a few layers and passes its activations to the next one. ",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about? ",
    "A quick brown fox jumps over the lazy dog while the cat sleeps in the sun. ",
    "Volunteers run nodes on laptops and servers; the leader places shards where "
    "demand appears, and every node proves its answers before anyone routes to it. ",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in text too. ",
    "system user assistant: please answer briefly and clearly. Yes, no, maybe. ",
)
# Qwen's ChatML template, so `apply_chat_template` output looks like a real
# Qwen3 prompt and the entry node's tokenisation path is the production one.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Sliding layers see this many tokens: fewer than the manifest's 8-token
# probe, so the doctor's probe tells a sliding mask from a full one.
SLIDING_WINDOW = 4
# Gemma 3 alternates 5 local layers with 1 global one; the tiny model keeps
# 2 to 1, so that even a 3-layer model has both kinds.
GEMMA3_PATTERN = 3
# Experts per MoE layer, and how many each token is routed to; the expert
# MLP is one quantization group wide (q8/q4 quantize along its width).
NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2
EXPERT_INTERMEDIATE_SIZE = 64
_GELU_TANH = "gelu_pytorch_tanh"

# Per family: architecture, model_type, and the config keys that set it
# apart from the common ones `_config` writes (what each real family's
# config.json carries). The rest of the difference is runtime/model/
# architectures.py's.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "llama": ("LlamaForCausalLM", "llama", {}),
    # Llama 3.1's rotary scaling, with the original context shrunk so that
    # the scaled frequencies are ones a short sequence turns through.
    "llama3": (
        "LlamaForCausalLM",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": False}),
    "mistral": ("MistralForCausalLM", "mistral", {"sliding_window": SLIDING_WINDOW}),
    "gemma2": (
        "Gemma2ForCausalLM",
        "gemma2",
        {
            "hidden_act": _GELU_TANH,
            "hidden_activation": _GELU_TANH,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "sliding_window": SLIDING_WINDOW,
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "gemma3_text",
        {
            "hidden_act": _GELU_TANH,
            "hidden_activation": _GELU_TANH,
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": GEMMA3_PATTERN,
            "rope_parameters": {
                architectures.FULL_ATTENTION: {"rope_type": "default", "rope_theta": 1_000_000.0},
                architectures.SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    # Phi-3's config defaults name its own tokenizer's padding and end
    # tokens, outside this vocabulary; the tiny tokenizer's ids replace
    # them (special tokens come first, in order).
    "phi3": (
        "Phi3ForCausalLM",
        "phi3",
        {
            "sliding_window": SLIDING_WINDOW,
            "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
            "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {
            "num_experts": NUM_EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": EXPERT_INTERMEDIATE_SIZE,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
}


def make_tiny_model(
    out_dir: Path,
    layers: int = 8,
    seed: int = 0,
    name: str | None = None,
    family: str = "qwen3",
    shards: int = 1,
    tie_embeddings: bool = False,
    with_manifest: bool = True,
    hidden_size: int = HIDDEN_SIZE,
    intermediate_size: int = INTERMEDIATE_SIZE,
    vocab_size: int | None = None,
    progress: Progress | None = None,
    chat_template: bool = True,
) -> Path:
    """Write a tiny random model to `out_dir` and return the directory.

    `family` names a key of FAMILIES (an architecture, or a variant of
    one such as Llama 3's rotary scaling); `shards` > 1 writes index-sharded
    safetensors (layers split evenly between files) so both layouts HF uses
    are exercised; `tie_embeddings` shares the embedding matrix with the LM
    head as small Qwen3 and Llama 3.2 checkpoints do (random tied models
    mostly echo their last token, since each embedding scores highest
    against itself, so the default is untied). `name` becomes the
    manifest's model name (default: the directory's name). The manifest
    (with golden activations) is written unless `with_manifest` is False.
    `hidden_size` and `intermediate_size` grow the model for benchmarks
    that need a decode step to cost real compute (see `_attention_shape`);
    `vocab_size` (default: the tokenizer's) pads the embedding and LM head
    to more rows than there are tokens, as real checkpoints do (Qwen3 has
    151936 rows for 151669 tokens), so that a benchmark's LM head costs
    what a real one does. `progress` hears of each phase. Without
    `chat_template` the tokenizer has none, as base models' often have not.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    if layers < 1 or shards < 1 or shards > layers:
        raise ValueError(f"need 1 <= shards <= layers, got layers={layers} shards={shards}")
    if hidden_size < HIDDEN_SIZE or hidden_size % HEAD_DIM or intermediate_size < 1:
        raise ValueError(
            f"hidden_size must be a multiple of {HEAD_DIM} and >= {HIDDEN_SIZE}; "
            "intermediate_size must be positive"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if progress:
        progress.phase("tokenizer and config")
    tokens = write_tokenizer(out, chat_template)
    if vocab_size is not None and vocab_size < tokens:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {tokens} tokens")
    config = _config(
        family, layers, vocab_size or tokens, tie_embeddings, hidden_size, intermediate_size
    )
    _write_json(out / "config.json", config)
    if progress:
        progress.phase(f"random weights, {layers} layers")
    _write_weights(out, config, seed, shards)
    if with_manifest:
        from runtime.model.manifest import build_manifest

        build_manifest(out, name=name, progress=progress)
    return out


def write_tokenizer(out: Path, chat_template: bool = True) -> int:
    """Write the tiny tokenizer (tokenizer.json, tokenizer_config.json with
    the chat template unless `chat_template` is False, generation_config.json)
    to `out`; returns its number of tokens. Any model directory may use it:
    the tests write it beside models that transformers itself saved."""
    tokenizer = _build_tokenizer()
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": tokenizer.token_to_id(PAD_TOKEN),
            "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
            "pad_token_id": tokenizer.token_to_id(PAD_TOKEN),
            "do_sample": False,
        },
    )
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "bos_token": None,
            "model_max_length": MAX_POSITIONS,
            **({"chat_template": CHAT_TEMPLATE} if chat_template else {}),
        },
    )
    return int(tokenizer.get_vocab_size())


def _attention_shape(hidden: int) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) for a hidden size: the tiny default
    (4 heads of 16, 2 KV heads) at 64, and heads of 64 with 2:1 grouped-query
    attention above, as real models of that width use."""
    if hidden == HIDDEN_SIZE:
        return NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    head_dim = LARGE_HEAD_DIM if hidden % LARGE_HEAD_DIM == 0 else HEAD_DIM
    heads = hidden // head_dim
    return heads, heads // 2 if heads % 2 == 0 else heads, head_dim


def _config(
    family: str, layers: int, vocab: int, tie: bool, hidden: int, intermediate: int
) -> dict[str, Any]:
    arch, model_type, extra = FAMILIES[family]
    heads, kv_heads, head_dim = _attention_shape(hidden)
    common = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "attention_bias": False,
        "tie_word_embeddings": tie,
        "vocab_size": vocab,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    config = {**common, **extra}
    if "query_pre_attn_scalar" in architectures.FAMILIES[arch].defaults:
        # Gemma scales queries by this**-0.5 instead of head_dim**-0.5; its
        # 2B and 9B models set it to the head width.
        config["query_pre_attn_scalar"] = head_dim
    return config


def _build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def _random_tensors(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    # Gemma applies its norms as (1 + w), so its weights centre on 0.
    norm_centre = 1.0 - architectures.family(config).norm_weight_offset
    # Sorted names fix the draw order, so a tensor's values depend only on
    # the seed and the geometry, never on dict order.
    for name, shape in sorted(expected_shapes(config, 0, config["num_hidden_layers"]).items()):
        if name.endswith("norm.weight"):
            values = norm_centre + NORM_JITTER * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            values = EMBEDDING_STD * rng.standard_normal(shape)
        else:
            values = PROJECTION_GAIN / np.sqrt(shape[-1]) * rng.standard_normal(shape)
        tensors[name] = values.astype(np.float32)
    return tensors


def _write_weights(out: Path, config: dict[str, Any], seed: int, shards: int) -> None:
    tensors = _random_tensors(config, seed)
    metadata = {"format": "pt"}  # transformers refuses safetensors without it
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if shards == 1:
        save_file(tensors, str(out / SINGLE_FILE), metadata=metadata)
        return
    layers = config["num_hidden_layers"]
    bounds = [round(k * layers / shards) for k in range(shards + 1)]

    def file_index(name: str) -> int:
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return next(k for k in range(shards) if bounds[k] <= layer < bounds[k + 1])
        return 0 if name == "model.embed_tokens.weight" else shards - 1

    weight_map: dict[str, str] = {}
    for k in range(shards):
        file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: t for n, t in tensors.items() if file_index(n) == k}
        save_file(part, str(out / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(part, file_name))
    total = sum(t.nbytes for t in tensors.values())
    _write_json(
        out / INDEX_FILE,
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
