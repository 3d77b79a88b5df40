"""`shardmesh manifest build`: a model's identity in the swarm and its golden activations.

DIR may be a hub model (`hf:REPO`): every weight file is fetched into its
folder in the user cache (`runtime.cli.model_source`) and the manifest is
written there, where `node --model hf:REPO` and `doctor` then find it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.cli.command import PROG, Commands, fail
from runtime.cli.model_source import MODEL_METAVAR, fetch_model, fetch_weights, model_source


def register(commands: Commands) -> None:
    manifest = commands.add_parser(
        "manifest",
        help="model manifests (a model's identity and golden activations)",
        description="Model manifests.",
    )
    manifest_commands = manifest.add_subparsers(
        dest="manifest_command", title="manifest commands", required=True
    )
    build = manifest_commands.add_parser(
        "build",
        help="compute DIR's manifest and golden activations",
        description=(
            "Hash DIR's config, tokenizer files and every tensor, compute fp32 golden "
            "activations of the probe at every layer boundary (one layer in memory at a "
            "time), write shardmesh-manifest.json and shardmesh-golden.safetensors into "
            "DIR, and print the manifest digest (the model's identity in the swarm)."
        ),
    )
    build.add_argument(
        "dir",
        type=model_source,
        metavar=MODEL_METAVAR,
        help="the model directory, or a Hugging Face Hub model (fetched whole into the user "
        "cache, where `node --model hf:REPO` finds its manifest)",
    )
    build.add_argument(
        "--name", default=None, help="model name (default: kept from an existing manifest)"
    )
    build.set_defaults(run=run_build)


def run_build(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.model.backends.base import BackendError  # NumPy and the model code
    from runtime.model.manifest import build_manifest, manifest_digest
    from runtime.model.progress import Progress

    if isinstance(args.dir, Path) and not args.dir.is_dir():
        return fail("manifest build", f"no directory at {args.dir}")
    try:
        folder = fetch_model(args.dir, "manifest build")
        fetch_weights(args.dir, "manifest build", folder)
        with Progress(f"{PROG} manifest build") as progress:
            manifest = build_manifest(folder, name=args.name, progress=progress)
    except (OSError, BackendError) as exc:
        return fail("manifest build", str(exc))
    print(manifest_digest(manifest))
    return 0
