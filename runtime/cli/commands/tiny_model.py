"""`shardmesh tiny-model`: a tiny random model, tokenizer and manifest included, for tests."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from runtime.cli import argtypes
from runtime.cli.command import PROG, Commands, fail

TINY_FAMILIES: Final = (
    "qwen3",
    "llama",
    "llama3",
    "qwen2",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "qwen3_moe",
)
"""`--family` choices: the keys of runtime.model.tiny.FAMILIES, named here so
that building the parser imports no NumPy (tests/runtime/model/test_architectures.py
checks the two agree)."""


def register(commands: Commands) -> None:
    tiny = commands.add_parser(
        "tiny-model",
        help="write a tiny random model (with tokenizer and manifest) for tests and demos",
        description=(
            "Write a tiny random model of one of the served architectures to OUT_DIR: "
            "config.json, "
            "safetensors weights, a real tokenizer with a chat template, and its manifest. "
            "The same seed gives byte-identical files. Prints the directory and the "
            "manifest digest."
        ),
    )
    tiny.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="where to write the model")
    tiny.add_argument(
        "--layers", type=argtypes.positive_int, default=8, help="decoder layers (default 8)"
    )
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.add_argument("--name", default=None, help="model name (default: the directory's name)")
    tiny.add_argument(
        "--family",
        choices=TINY_FAMILIES,
        default="qwen3",
        help="architecture (default qwen3; llama3 is Llama with Llama 3.1's rotary scaling)",
    )
    tiny.add_argument(
        "--hidden-size",
        type=argtypes.positive_int,
        default=64,
        help="residual width (default 64; larger for benchmarks, a multiple of 16)",
    )
    tiny.add_argument(
        "--intermediate-size",
        type=argtypes.positive_int,
        default=128,
        help="MLP width (default 128)",
    )
    tiny.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.model.backends.base import BackendError  # NumPy and the model code
    from runtime.model.manifest import load_manifest, manifest_digest
    from runtime.model.progress import Progress
    from runtime.model.tiny import make_tiny_model

    try:
        with Progress(f"{PROG} tiny-model") as progress:
            out = make_tiny_model(
                args.out_dir,
                layers=args.layers,
                seed=args.seed,
                name=args.name,
                family=args.family,
                hidden_size=args.hidden_size,
                intermediate_size=args.intermediate_size,
                progress=progress,
            )
        digest = manifest_digest(load_manifest(out))
    except (OSError, ValueError, BackendError) as exc:
        return fail("tiny-model", str(exc))
    print(out)
    print(digest)
    return 0
