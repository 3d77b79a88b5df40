"""`shardmesh node`: run a node until SIGTERM/SIGINT, then leave the swarm gracefully.

With `--model` (a folder or `hf:REPO`) and `--layers` it serves that shard,
pinned; the shard is checked before anything starts (`preflight`), so an
operator's mistake is one line and exit 2, not a failed admission after
joining. Without, it is spare capacity for managed placement.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.cli import argtypes
from runtime.cli.command import Commands, fail
from runtime.cli.flags import node_flags
from runtime.cli.model_source import (
    MODEL_METAVAR,
    ModelSourceError,
    fetch_model,
    fetch_weights,
    mistaken_hub_id,
    model_source,
    require_manifest,
)
from runtime.cli.node_process import configure_node_process, node_options, run_node

if TYPE_CHECKING:
    from runtime.model.hub import HubSource
    from runtime.node.admission import ServeOptions


def register(commands: Commands) -> None:
    node = commands.add_parser(
        "node",
        help="run a node: join the swarm and serve the HTTP API",
        description="Run a node until SIGTERM/SIGINT, then leave the swarm gracefully.",
    )
    node_flags(node, command="node")
    node.add_argument(
        "--model",
        type=model_source,
        default=None,
        metavar=MODEL_METAVAR,
        help="serve a shard of this model (pinned, operator tier; needs --layers): a folder, "
        "a GGUF file (imported once into the node's store), or a Hugging Face Hub model, of "
        "which only the shard's weight files are fetched",
    )
    node.add_argument(
        "--layers", type=argtypes.layer_span, default=None, metavar="A:B", help="the shard to serve"
    )
    node.add_argument(
        "--models",
        type=Path,
        default=None,
        metavar="STORE",
        help="a folder of model directories the placement leader may ask this node to load "
        "(a node without --model is spare capacity for managed placement)",
    )
    node.add_argument(
        "--auto-join",
        action="store_true",
        help="on first join, take the best gap for this node's memory and --models store "
        "as a bootstrap (pinned) assignment (not with --model)",
    )
    node.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    configure_node_process(args)
    try:
        options = node_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    if options.serve is not None:
        if (mistaken := mistaken_hub_id(args.model)) is not None:
            parser.error(mistaken)
        refused = check_shard(args.model, options.serve, options.state_dir)
        if refused is not None:
            return refused
    return run_node(options, "node")


def check_shard(source: Path | HubSource, serve: ServeOptions, state_dir: Path) -> int | None:
    """The pinned shard checked before anything starts, as the doctor's
    preflight sees it (a hub model's metadata fetched first, its span's
    weight files once it passes; a GGUF file imported into `state_dir`'s
    store first); the exit code of a refusal, else None."""
    from runtime.model.backends.base import BackendError  # NumPy: only for a shard
    from runtime.model.doctor import preflight

    try:
        folder = fetch_model(source, "node", state_dir=state_dir)
        require_manifest(source, folder)
        checked = preflight(serve.model_dir, *serve.layers, serve.recipe, serve.backend)
        if not checked.admitted:
            return fail("node", f"--model: {checked.message}", code=2)
        fetch_weights(source, "node", folder, serve.layers)
    except ModelSourceError as exc:
        return fail("node", f"--model: {exc}", code=2)
    except BackendError as exc:  # the hub could not give the model's files
        return fail("node", str(exc))
    return None
