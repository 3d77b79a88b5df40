"""The tiny model: deterministic files, a real tokenizer and chat template,
and outputs that depend on context (so tests built on it can fail)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from runtime.model.tiny import SPECIAL_TOKENS, make_tiny_model
from runtime.model.weights import INDEX_FILE, SafetensorsReader


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", layers=2, seed=7, name="tiny")
    b = make_tiny_model(tmp_path / "b", layers=2, seed=7, name="tiny")
    assert _files(a) == _files(b)
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "shardmesh-manifest.json",
    } <= set(_files(a))


def test_other_seed_gives_other_weights(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", layers=2, seed=1, with_manifest=False)
    b = make_tiny_model(tmp_path / "b", layers=2, seed=2, with_manifest=False)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_config_loads_in_transformers(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    assert config.num_hidden_layers == 8
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.architectures[0] in ("Qwen3ForCausalLM", "LlamaForCausalLM")


def test_tokenizer_and_chat_template(qwen3_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    specials = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert specials == [0, 1, 2]  # one id each, at the front of the vocabulary
    assert ids.count(specials[1]) == 2
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"
    plain = tokenizer("the swarm serves")["input_ids"]
    assert len(plain) < len("the swarm serves")  # BPE merges, not bytes
    config = json.loads((qwen3_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_decoding_is_not_degenerate(family: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, family=family, with_manifest=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = torch.tensor([[5, 40, 99, 250, 7]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False)[0, 5:].tolist()
        other = model.generate(prompt[:, 1:], max_new_tokens=16, do_sample=False)[0, 4:].tolist()
    assert len(set(out)) >= 4
    assert out != other  # the output depends on context


def test_index_sharded_layout(llama_dir: Path) -> None:
    index = json.loads((llama_dir / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert files == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert not (llama_dir / "model.safetensors").exists()
    assert sorted(index["weight_map"]) == SafetensorsReader(llama_dir).names()
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embeddings


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family"):
        make_tiny_model(tmp_path, family="gpt2")
    with pytest.raises(ValueError, match="shards"):
        make_tiny_model(tmp_path, layers=2, shards=3)
