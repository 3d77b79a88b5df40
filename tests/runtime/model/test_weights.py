"""Shard loading reads only the shard's tensors, and says clearly why not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch_file

from runtime.model.backends import BackendError, ShardSpec, backend_available, load_shard
from runtime.model.weights import (
    SafetensorsReader,
    ShardLoadError,
    expected_shapes,
    read_config,
    read_shard_tensors,
    tensor_names_for_shard,
)

LAYERS = 8


def _layer_bytes(reader: SafetensorsReader, layer: int) -> int:
    prefix = f"model.layers.{layer}."
    return sum(int(np.prod(reader.shape_of(n))) * 4 for n in reader.names() if n.startswith(prefix))


def test_names_per_shard(qwen3_dir: Path, llama_dir: Path) -> None:
    config = read_config(qwen3_dir)
    first = tensor_names_for_shard(config, 0, 3)
    middle = tensor_names_for_shard(config, 3, 6)
    last = tensor_names_for_shard(config, 6, 8)
    assert first[0] == "model.embed_tokens.weight"
    assert all(
        n.startswith(("model.layers.3.", "model.layers.4.", "model.layers.5.")) for n in middle
    )
    assert {"model.norm.weight", "lm_head.weight"} <= set(last)
    assert "model.layers.3.self_attn.q_norm.weight" in middle  # Qwen3's per-head norms
    assert sorted(first + middle + last) == SafetensorsReader(qwen3_dir).names()
    tied = read_config(llama_dir)
    last_tied = tensor_names_for_shard(tied, 6, 8)
    assert "model.embed_tokens.weight" in last_tied and "lm_head.weight" not in last_tied
    assert not any("q_norm" in n for n in last_tied)  # Llama has none


@pytest.mark.parametrize(("start", "end"), [(0, 2), (2, 4), (3, 6), (6, 8), (0, 8)])
def test_reads_only_the_shards_share(qwen3_dir: Path, start: int, end: int) -> None:
    reader = SafetensorsReader(qwen3_dir)
    total = reader.total_bytes
    file_size = (qwen3_dir / "model.safetensors").stat().st_size
    _, tensors = read_shard_tensors(qwen3_dir, start, end, reader)
    expected = sum(_layer_bytes(reader, i) for i in range(start, end))
    expected += sum(
        len(tensors[n].data)
        for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        if n in tensors
    )
    assert reader.bytes_read == expected
    layer_share = sum(_layer_bytes(reader, i) for i in range(LAYERS)) / total
    if start > 0 and end < LAYERS:  # a middle shard: exactly its layers' share
        assert reader.bytes_read / total == pytest.approx((end - start) / LAYERS * layer_share)
    if (start, end) == (2, 4):  # the quarter shard reads about a quarter, not the file
        assert reader.bytes_read < 0.3 * file_size
    assert reader.bytes_read <= total


def test_torch_shard_counts_its_bytes(qwen3_dir: Path) -> None:
    whole = SafetensorsReader(qwen3_dir).total_bytes
    shard = load_shard(ShardSpec(qwen3_dir, 2, 4, "fp32"), backend="torch")
    info = shard.info()
    assert info["bytes_read"] == info["weight_bytes"]
    assert info["bytes_read"] < 0.3 * whole


def test_index_sharded_reads_match_single_file(tmp_path: Path) -> None:
    from runtime.model.tiny import make_tiny_model

    single = make_tiny_model(tmp_path / "single", layers=4, seed=3, with_manifest=False)
    split = make_tiny_model(tmp_path / "split", layers=4, seed=3, shards=2, with_manifest=False)
    for start, end in [(0, 1), (1, 3), (3, 4)]:
        reader = SafetensorsReader(split)
        _, a = read_shard_tensors(single, start, end)
        _, b = read_shard_tensors(split, start, end, reader)
        assert a == b
        assert reader.bytes_read == sum(len(t.data) for t in b.values())
    # A shard inside the first file never opens the second one's data.
    reader = SafetensorsReader(split)
    read_shard_tensors(split, 1, 2, reader)
    assert {reader.file_of(n).name for n in tensor_names_for_shard(read_config(split), 1, 2)} == {
        "model-00001-of-00002.safetensors"
    }


def test_dtypes_round_trip(tmp_path: Path) -> None:
    values = torch.linspace(-3, 3, 64).reshape(8, 8)
    save_torch_file(
        {"f32": values, "bf16": values.bfloat16(), "f16": values.half()},
        str(tmp_path / "model.safetensors"),
    )
    tensors = SafetensorsReader(tmp_path).read(["f32", "bf16", "f16"])
    assert tensors["bf16"].dtype == "BF16" and tensors["bf16"].shape == (8, 8)
    assert np.array_equal(tensors["f32"].to_numpy(), values.numpy())
    assert np.array_equal(tensors["bf16"].to_numpy(), values.bfloat16().float().numpy())
    assert np.array_equal(tensors["f16"].to_numpy(), values.half().numpy())


def test_read_rows_reads_a_block(tmp_path: Path) -> None:
    """A block of rows is exactly that slice of the tensor, in any dtype,
    and only its bytes are read."""
    values = torch.linspace(-3, 3, 96).reshape(12, 4, 2)
    save_torch_file({"f32": values, "bf16": values.bfloat16()}, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(tmp_path)
    block = reader.read_rows("f32", 3, 7)
    assert block.shape == (4, 4, 2) and block.dtype == "F32"
    assert np.array_equal(block.to_numpy(), values[3:7].numpy())
    assert reader.bytes_read == 4 * 4 * 2 * 4
    last = reader.read_rows("bf16", 11, 12)
    assert np.array_equal(last.to_numpy(), values[11:].bfloat16().float().numpy())
    for start, stop in [(5, 5), (-1, 2), (10, 13)]:
        with pytest.raises(ShardLoadError, match=r"rows \[.*\) are outside tensor 'f32' of 12"):
            reader.read_rows("f32", start, stop)


# --- errors -----------------------------------------------------------------


@pytest.fixture
def copy_dir(qwen3_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(qwen3_dir, tmp_path / "model"))


def _edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_tensor_is_named(copy_dir: Path) -> None:
    weights = copy_dir / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.4.mlp.up_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    read_shard_tensors(copy_dir, 0, 4)  # other shards still load
    with pytest.raises(
        ShardLoadError,
        match=r"model\.safetensors: missing tensor "
        r"'model\.layers\.4\.mlp\.up_proj\.weight'",
    ):
        read_shard_tensors(copy_dir, 3, 6)
    with pytest.raises(BackendError, match="missing tensor"):
        load_shard(ShardSpec(copy_dir, 4, 5, "fp32"), backend="torch")


def test_missing_tensor_in_index(llama_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(llama_dir, tmp_path / "model"))
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ShardLoadError, match=r"index\.json: missing tensor 'model\.norm\.weight'"):
        read_shard_tensors(model, 7, 8)


def test_wrong_shape_is_reported(copy_dir: Path) -> None:
    _edit_config(copy_dir, intermediate_size=96)
    with pytest.raises(
        ShardLoadError,
        match=r"gate_proj\.weight' has shape \[128, 64\], "
        r"config\.json implies \[96, 64\]",
    ):
        read_shard_tensors(copy_dir, 0, 1)


def test_unsupported_architecture(copy_dir: Path) -> None:
    _edit_config(copy_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ShardLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        read_shard_tensors(copy_dir, 0, 1)
    with pytest.raises(BackendError, match="supported: Qwen3ForCausalLM, LlamaForCausalLM"):
        load_shard(ShardSpec(copy_dir, 0, 1, "fp32"), backend="torch")


@pytest.mark.parametrize(("start", "end"), [(6, 9), (3, 3), (5, 4), (-1, 2), (8, 9)])
def test_bad_layer_span(qwen3_dir: Path, start: int, end: int) -> None:
    with pytest.raises(ShardLoadError, match=rf"layer span \[{start}, {end}\).*8 layers"):
        expected_shapes(read_config(qwen3_dir), start, end)
    with pytest.raises(ShardLoadError, match="layer span"):
        load_shard(ShardSpec(qwen3_dir, start, end, "fp32"), backend="torch")


def test_truncated_file(copy_dir: Path) -> None:
    weights = copy_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(ShardLoadError, match="truncated"):
        SafetensorsReader(copy_dir)
    weights.write_bytes(data[:5])
    with pytest.raises(ShardLoadError, match="truncated"):
        SafetensorsReader(copy_dir)
    weights.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    with pytest.raises(ShardLoadError, match="header claims"):
        SafetensorsReader(copy_dir)


def test_no_weights_or_config(tmp_path: Path) -> None:
    with pytest.raises(ShardLoadError, match=r"neither model\.safetensors nor"):
        SafetensorsReader(tmp_path)
    with pytest.raises(ShardLoadError, match=r"no config\.json"):
        read_config(tmp_path)


def test_backend_choice_errors(qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ShardSpec(qwen3_dir, 0, 1, "fp32")
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        load_shard(spec, backend="tpu")
    import runtime.model.backends as backends

    monkeypatch.setitem(backends.REQUIRED_MODULES, "torch", ("no_such_module_for_shardmesh",))
    assert not backend_available("torch")
    with pytest.raises(BackendError, match=r"backend torch is not installed: pip install"):
        load_shard(spec, backend="torch")
