"""Importing a GGUF checkpoint as a model folder (`runtime.model.gguf_import`).

A tiny Llama (two layers, tied head) is written as a GGUF file with the `gguf` package's
own writer, laid out as llama.cpp's converter lays it out (q and k rows
permuted for its rotary, no `output.weight` for a tied head, the byte-level
BPE vocabulary and merges as a "gpt2" tokenizer), some tensors F32 and the
MLP quantized to Q8_0. The import must give back the checkpoint: the F32
tensors exactly (transformers un-permutes q and k), the quantized ones as
gguf dequantizes them, the tokenizer encoding as the original does, a
config our loaders take and a manifest. A failed import leaves no folder.
The real pretrained GGUF end to end is tests/runtime/model/test_pretrained.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from runtime.inference.chat import ModelTokenizer
from runtime.model.gguf_import import import_gguf
from runtime.model.manifest import has_chat_template, load_manifest
from runtime.model.progress import Progress
from runtime.model.tiny import CHAT_TEMPLATE, make_tiny_model
from runtime.model.weights import SINGLE_FILE, read_config

QUANTIZED = ("ffn_gate", "ffn_up", "ffn_down")
"""Written Q8_0; every other tensor F32."""
TEXTS = ["Tell me about the swarm of volunteers.", "<|im_start|>user\nhi<|im_end|>"]
HF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (convert_hf_to_gguf.py)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def checkpoint(model_dir: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def write_gguf(
    model_dir: Path, path: Path, chat_template: str | None = None
) -> dict[str, np.ndarray]:
    """`model_dir` (a tied Llama) as a GGUF file at `path`, with
    `chat_template` as its `tokenizer.chat_template` when given; the tensors
    as the import should give them back, by HF name."""
    config = read_config(model_dir)
    tensors = checkpoint(model_dir)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    special = {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    tokens = [token for token, _ in sorted({**vocab, **special}.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    )
    writer.add_eos_token_id(special["<|im_end|>"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_pad_token_id(special["<|endoftext|>"])
    expected = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    writer.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        for short, hf in HF_NAMES.items():
            name = f"model.layers.{i}.{hf}.weight"
            array = tensors[name]
            if short in QUANTIZED:
                q8 = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(
                    f"blk.{i}.{short}.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0
                )
                array = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
            elif short == "attn_q":
                writer.add_tensor(
                    f"blk.{i}.{short}.weight", permute(array, config["num_attention_heads"])
                )
            elif short == "attn_k":
                writer.add_tensor(
                    f"blk.{i}.{short}.weight", permute(array, config["num_key_value_heads"])
                )
            else:
                writer.add_tensor(f"blk.{i}.{short}.weight", array)
            expected[name] = array
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    expected["model.norm.weight"] = tensors["model.norm.weight"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer tiny Llama with a tied head (two layers are enough to show
    each block's tensors mapped, and keep the manifest's goldens quick)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-llama",
        layers=2,
        seed=1,
        family="llama",
        shards=2,
        tie_embeddings=True,
        with_manifest=False,
    )


@pytest.fixture(scope="module")
def gguf_file(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return path, write_gguf(llama, path)


@pytest.fixture(scope="module")
def imported(
    gguf_file: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[str]]:
    lines: list[str] = []
    with Progress("import", emit=lines.append) as progress:
        out = import_gguf(
            gguf_file[0], tmp_path_factory.mktemp("out") / "tiny", "tiny-gguf", progress
        )
    return out, lines


def test_the_import_gives_back_the_checkpoints_tensors(
    gguf_file: tuple[Path, dict[str, np.ndarray]], imported: tuple[Path, list[str]]
) -> None:
    expected = gguf_file[1]
    out, _ = imported
    weights = load_file(out / SINGLE_FILE)
    assert set(weights) == set(expected)  # the tied head is held once, as the embedding
    for name, array in expected.items():
        assert weights[name].dtype == np.float32, name
        np.testing.assert_array_equal(weights[name], array, err_msg=name)


def test_the_folder_is_one_our_loaders_take(llama: Path, imported: tuple[Path, list[str]]) -> None:
    out, lines = imported
    assert not out.with_name(out.name + ".partial").exists()
    raw = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in raw  # the weights are plain fp32 now
    config, original = read_config(out), read_config(llama)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "head_dim", "vocab_size"):  # fmt: skip
        assert config[key] == original[key], key
    # GGUF holds the epsilon as a float32.
    assert config["rms_norm_eps"] == pytest.approx(original["rms_norm_eps"], rel=1e-6)
    assert (out / "generation_config.json").exists()
    manifest = load_manifest(out)
    assert manifest["name"] == "tiny-gguf"
    assert manifest["num_layers"] == original["num_hidden_layers"]
    assert any("reading tiny-llama.Q8_0.gguf" in line for line in lines), lines
    assert any("converting the tokenizer" in line for line in lines), lines


def test_the_tokenizer_encodes_as_the_original(
    llama: Path, imported: tuple[Path, list[str]]
) -> None:
    original = AutoTokenizer.from_pretrained(llama)
    converted = AutoTokenizer.from_pretrained(imported[0])
    for text in TEXTS:
        ids = original(text, add_special_tokens=False)["input_ids"]
        assert converted(text, add_special_tokens=False)["input_ids"] == ids, text
        assert converted.decode(ids) == text
    assert converted.eos_token == "<|im_end|>"


def test_a_gguf_chat_template_is_kept_and_none_is_made_up(
    llama: Path, imported: tuple[Path, list[str]], tmp_path: Path
) -> None:
    assert not has_chat_template(imported[0])  # the fixture's GGUF has none
    path = tmp_path / "templated.gguf"
    write_gguf(llama, path, chat_template=CHAT_TEMPLATE)
    out = import_gguf(path, tmp_path / "templated")
    assert has_chat_template(out)
    tokenizer = ModelTokenizer(out)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(tokenizer.encode_chat(messages)) == "user\nhi\nassistant\n"


def test_an_existing_folder_is_never_imported_into(
    gguf_file: tuple[Path, Any], tmp_path: Path
) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="import into a new folder"):
        import_gguf(gguf_file[0], tmp_path / "out")


def test_a_failed_import_leaves_no_folder(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)  # a header cut short
    with pytest.raises(Exception):  # noqa: B017 (whatever the reader raises)
        import_gguf(broken, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]
