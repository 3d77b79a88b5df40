"""`shardmesh serve`: from a model folder (a GGUF file, a hub model) to serving it, in one command.

It checks the model before anything joins (fetches a hub model's metadata,
imports a GGUF file once into the node's store), then runs a node that
stocks its store with the model and
auto-joins: the swarm's bootstrap suggestion picks the layers it lacks
(`runtime.node.provision`). It shares `node`'s flags (`runtime.cli.flags`),
but never pins a shard.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.cli.command import Commands, fail
from runtime.cli.config_file import subcommand
from runtime.cli.flags import node_flags
from runtime.cli.model_source import (
    MODEL_METAVAR,
    ModelSourceError,
    fetch_model,
    is_gguf,
    mistaken_hub_id,
    model_source,
)
from runtime.cli.node_process import configure_node_process, node_options, run_node

if TYPE_CHECKING:
    from runtime.node.options import Provision

NO_MODEL = "name a MODEL_DIR or FILE.gguf, or a hub model with --model hf:REPO[@REVISION]"
TWO_FOLDERS = "name the model folder once: MODEL_DIR or --model DIR"


class Unservable(Exception):
    """What `serve` refuses before it joins anything: a usage-like mistake."""


def register(commands: Commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model folder (a GGUF file, a hub model): from nothing to serving in one "
        "command",
        description=(
            "Put MODEL_DIR in this node's store (its manifest taken from a swarm member that "
            "has the same model, verified against the files, else built here), join the "
            "swarm (or found one, without --join), take the layers the swarm lacks (the "
            "leader's bootstrap suggestion: a founder takes the whole model, or as much as "
            "fits), run the doctor, and serve them. With --model hf:REPO[@REVISION] the "
            "files come from the Hugging Face Hub, and only those of the layers taken. A "
            "FILE.gguf is imported into the node's store first (once: the same file again "
            "serves that import), its chat template kept."
        ),
    )
    serve.add_argument(
        "model_dir",
        type=Path,
        nargs="?",
        default=None,
        metavar="MODEL_DIR",
        help="the model folder (config.json, tokenizer, safetensors) or a GGUF file; with "
        "--model hf:, where its files go (default: a folder in the user cache)",
    )
    serve.add_argument(
        "--model",
        dest="source",
        type=model_source,
        default=None,
        metavar=MODEL_METAVAR,
        help="the model folder (as MODEL_DIR), or a model to fetch from the Hugging Face Hub "
        "($HF_ENDPOINT, $HF_TOKEN): config, tokenizer and index first, then only the weight "
        "files of the layers taken",
    )
    serve.add_argument(
        "--name",
        default=None,
        help="the model's name when this node builds its manifest (default: the hub "
        "repository's name, else the folder's); a member's manifest brings the swarm's",
    )
    node_flags(serve, command="serve")
    # What `node_options` reads of `node`'s own flags: serve never pins a
    # shard and always takes the suggestion's.
    serve.set_defaults(model=None, layers=None, models=None, auto_join=True, run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the model, then run the node. Usage errors show serve's own
    usage, not the top-level parser's."""
    from runtime.model.backends.base import BackendError  # NumPy: only when serving

    parser = subcommand(parser, "serve")
    configure_node_process(args)
    if args.model_dir is None and args.source is None:
        parser.error(NO_MODEL)
    if isinstance(args.source, Path) and args.model_dir is not None:
        parser.error(TWO_FOLDERS)
    if is_gguf(args.model_dir) and args.source is not None:
        parser.error(TWO_FOLDERS)
    if (mistaken := mistaken_hub_id(args.source)) is not None:
        parser.error(mistaken)
    try:
        options = node_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        provision = preflight(args, options.state_dir)
    except (Unservable, ModelSourceError) as exc:
        return fail("serve", str(exc), code=2)
    except BackendError as exc:  # the hub could not give the model's files
        return fail("serve", str(exc))
    return run_node(replace(options, provision=provision), "serve")


def preflight(args: argparse.Namespace, state_dir: Path) -> Provision:
    """What `serve` checks before it joins: the backend is installed, the
    folder is a model of a supported architecture (for a hub model, once
    its config, tokenizer and index are fetched: BackendError if they
    cannot be; a GGUF file once imported into `state_dir`'s store:
    ModelSourceError if it cannot be), and an existing manifest is
    readable. Unservable says why not."""
    from runtime.model.doctor import backend_refusal
    from runtime.model.manifest import MANIFEST_FILE, ManifestError, load_manifest
    from runtime.model.weights import SafetensorsReader, ShardLoadError, read_config
    from runtime.node.options import Provision

    refusal = backend_refusal(args.backend)
    if refusal is not None:
        raise Unservable(refusal)
    hub = None if isinstance(args.source, Path) else args.source
    source = args.source or args.model_dir
    folder = fetch_model(
        source, "serve", folder=args.model_dir, state_dir=state_dir, name=args.name
    )
    if hub is None and not folder.is_dir():
        raise Unservable(f"{folder}: no such model folder")
    try:
        read_config(folder)
        if hub is None:
            SafetensorsReader(folder)  # the weights are there (headers only)
        if (folder / MANIFEST_FILE).is_file():
            load_manifest(folder)
    except (ShardLoadError, ManifestError) as exc:
        raise Unservable(str(exc)) from None
    return Provision(model_dir=folder.resolve(), hub=hub, name=args.name)
