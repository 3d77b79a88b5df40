"""Mistakes caught before a node joins: one line saying what to do, exit 2,
and nothing started (no state dir written, no port bound)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from runtime.model.tiny import make_tiny_model


def node(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", "node", "--listen", "127.0.0.1:0",
         "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip


def test_each_mistake_is_one_line_before_joining(qwen3_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (
            ["--model", str(tmp_path / "nowhere"), "--layers", "0:2"],
            f"shardmesh node: error: --model: {tmp_path / 'nowhere'}: no such model folder; "
            "give the folder that holds config.json, the safetensors files and "
            "shardmesh-manifest.json",
        ),
        (
            ["--model", str(qwen3_dir), "--layers", "0:99"],
            "shardmesh node: error: --model: layer span [0, 99) is not a non-empty part "
            "of the model's 8 layers [0, 8)",
        ),
        (
            ["--model", str(empty), "--layers", "0:2"],
            f"shardmesh node: error: --model: {empty / 'shardmesh-manifest.json'}: no manifest; "
            f"run `shardmesh manifest build {empty}`",
        ),
    ]
    moe = make_tiny_model(tmp_path / "moe", layers=2, family="qwen3_moe")
    cases.append(
        (
            ["--model", str(moe), "--layers", "0:2", "--recipe", "q8", "--backend", "torch"],
            "shardmesh node: error: --model: backend torch does not run recipe q8 for "
            "Qwen3MoeForCausalLM: its experts are fused parameters that torch's q8/q4 (which "
            "quantize Linear projections) would leave in float32; use fp32, bf16 or fp16 on "
            "torch, or q8/q4 on mlx",
        )
    )
    for number, (args, line) in enumerate(cases):
        state_dir = tmp_path / f"state{number}"
        done = node(state_dir, *args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [line]
        assert not state_dir.exists()  # refused before anything started
