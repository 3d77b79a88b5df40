"""The `shardmesh` command line.

Commands: `node` (run a node), `serve` (a node that serves a model folder,
or a hub model, in one command), `status` (a node's view of the swarm),
`chat` (stream an answer), `demo` (a local swarm on loopback), `simulate`
(a scenario in the deterministic simulator), `tiny-model` (a tiny random
model for tests and demos), `manifest build` (a model's identity and golden
activations), `policy` (show or change the swarm's placement knobs),
`voters` (who votes, and making a node eligible to), `invite` and
`doctor` (check that this machine computes a shard correctly). Each command's
code lives beside this module in runtime/cli/ or is imported when it runs, so
`shardmesh --help` stays fast.
Usage errors exit 2 with the usage line, as argparse does; runtime errors
(state dir in use, port taken, node unreachable, a model directory that
cannot be read) exit 1 with one line on stderr saying what went wrong.
`doctor` exits 0 only when the shard is admitted; a refusal exits 1 and
says which check failed and by how much.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, NewType

from runtime.node.hostport import (
    EndpointError,
    HostPort,
    Seed,
    api_url,
    parse_hostport,
    parse_seed,
)

if TYPE_CHECKING:  # imported when used: `shardmesh --help` stays fast
    from runtime.cli.chat_client import ChatResult
    from runtime.model.hub import HubSource
    from runtime.node.options import NodeOptions, Provision

PROG = "shardmesh"
# `tiny-model --family` choices: the keys of runtime.model.tiny.FAMILIES,
# named here so that building the parser imports no NumPy
# (tests/runtime/model/test_architectures.py checks the two agree).
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
NODE_COMMANDS: Final = ("node", "serve")
"""The commands that run a node: they share its flags and `--config FILE`."""
SERVE_LISTEN: Final = HostPort("127.0.0.1", 0)
"""`serve` without --listen: a free port on loopback. Safe by default (no
one else can reach the node); a volunteer serving others passes
`--listen 0.0.0.0:PORT --advertise THEIR_ADDRESS`, as for `node`."""
CHAT_WAIT_S = 300.0
"""How long `chat` keeps asking while the swarm places and loads the model:
the request is the demand that gets it placed, and a model of a few GB
takes minutes to load on a volunteer's disk. Each wait prints why."""


def _hostport(text: str) -> HostPort:  # argparse `type=`: a bad value becomes a usage error
    try:
        return parse_hostport(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seed(text: str) -> Seed:
    try:
        return parse_seed(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _url(text: str) -> str:
    try:
        return api_url(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


DURATION_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """`90`, `30m`, `24h`, `7d` as seconds (argparse `type=`)."""
    unit = DURATION_UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1.0)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90s, 30m, 24h, 7d")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def _node_id(text: str) -> str:
    from mesh.identity import node_id_from_text, node_id_text

    try:
        return node_id_text(node_id_from_text(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node id: {exc}") from None


def _setting(text: str) -> tuple[str, int | float]:
    from runtime.cli.policy_client import parse_setting

    try:
        return parse_setting(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


SIZE_UNITS: Final = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
"""`--max-memory`'s suffixes: binary, as memory is sold and reported."""
ByteSize = NewType("ByteSize", int)
"""A size written with a unit (`8G`): not a plain number, so a config file
spells it as the command line does, a string (`runtime.cli.config_file`)."""


def _size(text: str) -> ByteSize:
    """`8G`, `512M`, `1.5g`, `1048576` as bytes (argparse `type=`)."""
    unit = SIZE_UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        value = 0.0
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 8G, 512M or 1048576")
    return ByteSize(int(value))


def _hub_source(text: str) -> HubSource:
    from runtime.model.hub import HubSource

    try:
        return HubSource.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layer_span(text: str) -> tuple[int, int]:
    """`A:B` -> (A, B). Only the syntax is checked here: whether the span
    fits the model is the doctor's `span` check, reported like any refusal."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(start), int(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (e.g. 0:4)") from None


def _node_flags(parser: argparse.ArgumentParser, *, command: str) -> None:
    """The flags `node` and `serve` share, defined once: a flag means the
    same in both commands and in both commands' --config files. `serve`
    listens on a free loopback port unless told otherwise (`node` must be
    told)."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="read flags from this TOML file: keys are the flags without -- "
        '(data-listen = "H:P", join = ["ID@H:P"], max-sessions = 8); relative paths are '
        "relative to the file's folder; flags given here win over it",
    )
    serving = command == "serve"
    parser.add_argument(
        "--listen",
        required=not serving,
        default=SERVE_LISTEN if serving else None,
        type=_hostport,
        metavar="H:P",
        help="control-plane (membership) address; port 0 picks a free port"
        + (f" (default {SERVE_LISTEN.text()}: this machine only)" if serving else ""),
    )
    parser.add_argument(
        "--join",
        action="append",
        default=[],
        type=_seed,
        metavar="ID@H:P",
        help="id and control address of any node already in the swarm, as it prints "
        "them at start (repeatable)",
    )
    parser.add_argument(
        "--api",
        type=_hostport,
        default=None,
        metavar="H:P",
        help="HTTP API address (default: a free port on 127.0.0.1, or with --advertise on "
        "the --listen host, so the advertised API is reachable; see the log line)",
    )
    parser.add_argument(
        "--data-listen",
        type=_hostport,
        default=None,
        metavar="H:P",
        help="data-plane (activations) address (default: the --listen host, a free port)",
    )
    parser.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="host peers should dial, required when --listen is a wildcard like 0.0.0.0",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="identity key and incarnation (default: the platform's user state dir)",
    )
    parser.add_argument(
        "--profile",
        choices=("lan", "wan", "local"),
        default="lan",
        help="membership and consensus timing profile (default lan; local is for one machine)",
    )
    parser.add_argument(
        "--swarm",
        choices=("open", "private"),
        default="open",
        help="when this node founds a swarm (no --join): open lets any node join; private "
        "only nodes invited with `shardmesh invite` (fixed for good; default open)",
    )
    parser.add_argument(
        "--invite",
        default=None,
        metavar="TOKEN",
        help="join a private swarm: redeem this invitation (from `shardmesh invite`), then "
        "join through the node that issued it",
    )
    parser.add_argument(
        "--recipe",
        default=None,
        choices=("fp32", "bf16", "fp16", "q8", "q4"),
        help="numeric recipe of the shard (default: fp32 for --model; for a span the swarm "
        "suggests, the precision the model is stored in)",
    )
    parser.add_argument(
        "--backend",
        choices=("torch", "mlx"),
        default=None,
        help="compute backend (default: MLX on Apple silicon, torch elsewhere)",
    )
    parser.add_argument(
        "--max-memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="the most memory this node offers placement for a shard, e.g. 8G or 512M "
        "(default: what is free when it starts)",
    )
    parser.add_argument(
        "--capability-ttl",
        type=float,
        default=None,
        metavar="S",
        help="seconds a doctor report stays valid (default 600)",
    )
    parser.add_argument(
        "--capability-refresh",
        type=float,
        default=None,
        metavar="S",
        help="seconds between cheap re-checks that refresh it (default: half the TTL)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        metavar="N",
        help="concurrent inference sessions this node serves (default 16)",
    )
    parser.add_argument(
        "--max-chats-per-client",
        type=_positive_int,
        default=None,
        metavar="N",
        help="chats one HTTP client (one IP address, an IPv6 /64) may run at once on this "
        "node; more get 429 (default 4; behind a reverse proxy all clients share one)",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="CPU threads for the torch backend (default: all cores; 1 when several "
        "nodes share one machine)",
    )
    parser.add_argument(
        "--fault-injection",
        action="store_true",
        help="serve POST /v1/debug/faults, which can cut this node off (tests only)",
    )
    parser.add_argument(
        "--insecure-plaintext",
        action="store_true",
        # Hidden: it exists so benchmarks.pipeline can measure what CURVE
        # costs. Such a node talks only to other plaintext nodes.
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING"),
        help="logging threshold on stderr (default INFO)",
    )


def _token_arguments(command: argparse.ArgumentParser) -> None:
    """Where an admin command finds the node's operator token
    (`runtime.cli.operator_token`; else SHARDMESH_TOKEN)."""
    where = command.add_mutually_exclusive_group()
    where.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="a file holding the node's operator token (default: $SHARDMESH_TOKEN, "
        "else the default state dir's)",
    )
    where.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the node's state dir: read its operator.token",
    )


def package_version() -> str:
    """The installed package's version (`importlib.metadata`), else says so."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PROG)
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """`--version`: asks the package metadata only when given, so that
    every other command starts without looking it up."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"{PROG} {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A peer-to-peer swarm that serves large language models.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="print the version of shardmesh and exit"
    )
    commands = parser.add_subparsers(dest="command", title="commands", required=True)

    node = commands.add_parser(
        "node",
        help="run a node: join the swarm and serve the HTTP API",
        description="Run a node until SIGTERM/SIGINT, then leave the swarm gracefully.",
    )
    _node_flags(node, command="node")
    node.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="serve a shard of this model (pinned, operator tier; needs --layers)",
    )
    node.add_argument(
        "--layers", type=_layer_span, default=None, metavar="A:B", help="the shard to serve"
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

    serve = commands.add_parser(
        "serve",
        help="serve a model folder (or a hub model): from nothing to serving in one command",
        description=(
            "Put MODEL_DIR in this node's store (its manifest taken from a swarm member that "
            "has the same model, verified against the files, else built here), join the "
            "swarm (or found one, without --join), take the layers the swarm lacks (the "
            "leader's bootstrap suggestion: a founder takes the whole model, or as much as "
            "fits), run the doctor, and serve them. With --model hf:REPO[@REVISION] the "
            "files come from the Hugging Face Hub, and only those of the layers taken."
        ),
    )
    serve.add_argument(
        "model_dir",
        type=Path,
        nargs="?",
        default=None,
        metavar="MODEL_DIR",
        help="the model folder (config.json, tokenizer, safetensors); with --model hf:, "
        "where its files go (default: a folder in the user cache)",
    )
    serve.add_argument(
        "--model",
        dest="hub",
        type=_hub_source,
        default=None,
        metavar="hf:REPO[@REVISION]",
        help="fetch the model from the Hugging Face Hub ($HF_ENDPOINT, $HF_TOKEN): config, "
        "tokenizer and index first, then only the weight files of the layers taken",
    )
    serve.add_argument(
        "--name",
        default=None,
        help="the model's name when this node builds its manifest (default: the hub "
        "repository's name, else the folder's); a member's manifest brings the swarm's",
    )
    _node_flags(serve, command="serve")
    # What `node_options` reads of `node`'s own flags: serve never pins a
    # shard and always takes the suggestion's.
    serve.set_defaults(model=None, layers=None, models=None, auto_join=True)

    status = commands.add_parser(
        "status",
        help="show a node's view of the swarm",
        description="Fetch GET /v1/network/status from a node and print it.",
    )
    status.add_argument(
        "--api",
        required=True,
        type=_url,
        metavar="URL",
        help="the node's API, http://H:P or H:P",
    )
    status.add_argument("--json", action="store_true", help="print the raw JSON document")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")

    chat = commands.add_parser(
        "chat",
        help="stream a chat answer from the swarm",
        description="POST one streaming chat completion to a node and print it as it arrives.",
    )
    chat.add_argument("--api", required=True, type=_url, metavar="URL", help="any node's API")
    chat.add_argument("--model", required=True, metavar="NAME", help="the model's name")
    chat.add_argument("prompt", metavar="PROMPT", help="the user message")
    chat.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="most tokens to generate"
    )
    chat.add_argument(
        "--temperature", type=float, default=None, metavar="T", help="sampling temperature"
    )
    chat.add_argument(
        "--seed", type=int, default=None, metavar="S", help="sampling seed (same seed, same text)"
    )
    chat.add_argument(
        "--wait",
        type=_seconds,
        default=CHAT_WAIT_S,
        metavar="SECONDS",
        help=(
            "while the swarm is still placing or loading the model, keep asking for this "
            f"long, showing its progress (default {CHAT_WAIT_S:.0f}; 0: fail at once)"
        ),
    )

    demo = commands.add_parser(
        "demo",
        help="start a local swarm on loopback and show it working",
        description=(
            "Make a tiny model, start nodes on 127.0.0.1 as subprocesses (three serve a "
            "third of it each), show them converge, stream a chat answer through the "
            "chain, place a second model on demand, SIGKILL a node and show every "
            "survivor declare it dead, then stop the rest gracefully."
        ),
    )
    demo.add_argument("--nodes", type=int, default=5, help="how many nodes (default 5)")
    demo.add_argument(
        "--profile",
        choices=("lan", "wan", "local"),
        default="local",
        help="membership profile of the nodes (default local)",
    )
    demo.add_argument("--keep", action="store_true", help="keep the state dirs and logs")

    simulate = commands.add_parser(
        "simulate",
        help="run a scenario in the deterministic simulator",
        description=(
            "Run the real membership core on simulated nodes, links and faults described "
            "by a TOML scenario (examples: simulations/scenarios/); a scenario with a "
            "[placement] table runs demand placement on the real Raft and ledger instead. "
            "Same seed, same results and trace digest."
        ),
    )
    simulate.add_argument(
        "scenario", type=Path, nargs="?", metavar="SCENARIO.toml", help="the scenario"
    )
    simulate.add_argument(
        "--schema",
        action="store_true",
        help="print every key a scenario may hold (Markdown) and exit",
    )
    simulate.add_argument("--seed", type=int, default=1, help="run seed (default 1)")
    simulate.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=(
            "also write metrics.json, timeline.txt (the traced events) and PNG plots "
            "(membership beliefs, traffic, record spread over time) into DIR"
        ),
    )
    simulate.add_argument("--json", action="store_true", help="print the metrics as JSON")
    sweep = simulate.add_argument_group(
        "sweeps", "run a grid of seeds x settings, one CSV row per run (simulations.sweep)"
    )
    sweep.add_argument("--seeds", metavar="A..B", help="seeds to sweep: 1..50, or 1,2,7")
    sweep.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="sweep a scenario key over values, e.g. membership.suspicion_mult=2,3,4 "
        "(repeatable: the grid is every combination)",
    )
    sweep.add_argument(
        "--jobs", type=_positive_int, default=1, help="runs in parallel processes (default 1)"
    )
    sweep.add_argument(
        "--csv", type=Path, metavar="FILE", help="write the sweep's rows here (default: stdout)"
    )

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
    tiny.add_argument("--layers", type=_positive_int, default=8, help="decoder layers (default 8)")
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
        type=_positive_int,
        default=64,
        help="residual width (default 64; larger for benchmarks, a multiple of 16)",
    )
    tiny.add_argument(
        "--intermediate-size", type=_positive_int, default=128, help="MLP width (default 128)"
    )

    manifest = commands.add_parser(
        "manifest",
        help="model manifests (a model's identity and golden activations)",
        description="Model manifests.",
    )
    manifest_commands = manifest.add_subparsers(
        dest="manifest_command", title="manifest commands", required=True
    )
    manifest_build = manifest_commands.add_parser(
        "build",
        help="compute DIR's manifest and golden activations",
        description=(
            "Hash DIR's config, tokenizer files and every tensor, compute fp32 golden "
            "activations of the probe at every layer boundary (one layer in memory at a "
            "time), write shardmesh-manifest.json and shardmesh-golden.safetensors into "
            "DIR, and print the manifest digest (the model's identity in the swarm)."
        ),
    )
    manifest_build.add_argument("dir", type=Path, metavar="DIR", help="the model directory")
    manifest_build.add_argument(
        "--name", default=None, help="model name (default: kept from an existing manifest)"
    )

    policy = commands.add_parser(
        "policy",
        help="show or change the swarm's placement policy",
        description=(
            "Show the placement policy every leader uses (one set of knobs for the whole "
            "swarm, kept in the placement ledger), or change knobs with --set: any node "
            "forwards the change to the leader, which commits it for every node. A change "
            "needs the asked node's operator token (--token-file, --state-dir or "
            "SHARDMESH_TOKEN)."
        ),
    )
    policy.add_argument("--api", required=True, type=_url, metavar="URL", help="any node's API")
    policy.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        type=_setting,
        metavar="NAME=VALUE",
        help="change a knob, e.g. idle_release_s=600 (repeatable; one commit for all)",
    )
    policy.add_argument("--json", action="store_true", help="print the raw JSON answer")
    _token_arguments(policy)
    policy.add_argument(
        "--timeout",
        type=_seconds,
        default=10.0,
        help="seconds to wait for an answer, and for a leader while one is elected (default 10)",
    )

    voters = commands.add_parser(
        "voters",
        help="show who votes in the swarm's Raft, or make a node eligible to",
        description=(
            "Only eligible nodes ever become Raft voters: the founder, and the nodes an "
            "operator makes eligible here (or invites with `shardmesh invite --voter`). "
            "A voter can change what the whole swarm decides, so make eligible only nodes "
            "you trust; a swarm needs 3 eligible nodes to keep a leader when one fails."
        ),
    )
    voters_commands = voters.add_subparsers(
        dest="voters_command", title="voters commands", required=True
    )
    voters_list = voters_commands.add_parser(
        "list", help="who votes, who learns, who may vote", description="Show the voters."
    )
    voters_add = voters_commands.add_parser(
        "add",
        help="make NODE_ID eligible to vote (committed in the ledger)",
        description=(
            "Commit that NODE_ID may become a voter; the leader promotes it once it is "
            "stable. Needs the asked node's operator token (--token-file, --state-dir or "
            "SHARDMESH_TOKEN)."
        ),
    )
    voters_add.add_argument("node_id", type=_node_id, metavar="NODE_ID", help="the node's id")
    _token_arguments(voters_add)
    voters_refound = voters_commands.add_parser(
        "refound",
        help="make the node at --api the only voter (the voters are gone for good)",
        description=(
            "When the voters are gone for good (a founder that died before anyone was "
            "promoted, or voters lost past recovery) the swarm has no leader, ever. This "
            "makes the node at --api the only voter and its leader; the voter policy then "
            "promotes eligible nodes again. Entries that only the lost voters held are "
            "lost, so run it on the surviving eligible node with the longest log "
            "(`shardmesh status` shows raft.last_index). The node refuses until it has had "
            "no leader for the profile's dead-voter grace. Needs that node's own operator "
            "token (--token-file, --state-dir or SHARDMESH_TOKEN)."
        ),
    )
    _token_arguments(voters_refound)
    for sub in (voters_list, voters_add, voters_refound):
        sub.add_argument("--api", required=True, type=_url, metavar="URL", help="any node's API")
        sub.add_argument("--json", action="store_true", help="print the raw JSON answer")
        sub.add_argument(
            "--timeout",
            type=_seconds,
            default=10.0,
            help="seconds to wait for an answer, and for a leader while one is elected",
        )

    invite = commands.add_parser(
        "invite",
        help="invite a node to a private swarm (prints a token for its --invite)",
        description=(
            "Ask a voter of a private swarm for an invitation: a token, signed by that "
            "voter, that lets one node join with `shardmesh node --invite TOKEN` until it "
            "expires. Whoever holds it can join: hand it over privately. Needs the node's "
            "operator token (--token-file, --state-dir or SHARDMESH_TOKEN)."
        ),
    )
    invite.add_argument("--api", required=True, type=_url, metavar="URL", help="a voter's API")
    invite.add_argument(
        "--voter",
        action="store_true",
        help="the newcomer may become a voter (it is eligible, and can then invite too)",
    )
    invite.add_argument(
        "--expires",
        type=_duration,
        default=24 * 3600.0,
        metavar="DURATION",
        help="how long the token stays redeemable, e.g. 30m, 24h, 7d (default 24h)",
    )
    _token_arguments(invite)

    doctor = commands.add_parser(
        "doctor",
        help="check that this machine computes a shard correctly (node admission)",
        description=(
            "Check the environment, the manifest, the shard's tensor digests and a real "
            "forward pass of the manifest's probe against its golden activations, then "
            "measure throughput. Exits 0 only when the shard is admitted."
        ),
    )
    doctor.add_argument("--model", required=True, type=Path, metavar="DIR", help="model directory")
    doctor.add_argument(
        "--layers",
        required=True,
        type=_layer_span,
        metavar="A:B",
        help="the shard: layers A (inclusive) to B (exclusive)",
    )
    doctor.add_argument("--recipe", required=True, metavar="R", help="fp32, bf16, fp16, q8 or q4")
    doctor.add_argument(
        "--backend",
        choices=("torch", "mlx"),
        default=None,
        help="compute backend (default: mlx on Apple silicon, torch elsewhere)",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-measure", action="store_true", help="skip the throughput measurement")
    return parser


COMPUTE_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "20000"}
"""Set before torch loads (libgomp reads it once). A node computes in bursts
between network waits. libgomp's default spin (300,000 iterations) keeps
idle workers burning the cores the node's event loop, and any node beside
it, needs next (measured on loopback: 11 ms per hop); never spinning
(OMP_WAIT_POLICY=PASSIVE) re-wakes the workers at every parallel region of
a forward. A short spin keeps them warm within a forward and asleep between
steps (measured: ~0.9-1.5 ms per hop). An operator's own setting wins."""


def node_options(args: argparse.Namespace) -> NodeOptions:
    """The options a `node` or `serve` command line (and its --config file)
    asks for; starts nothing. A combination of flags that cannot work
    raises ValueError (a usage error)."""
    from runtime.inference.hop_server import DEFAULT_MAX_SESSIONS
    from runtime.node.admission import DEFAULT_RECIPE, DEFAULT_TTL_S, ServeOptions
    from runtime.node.options import NodeOptions
    from runtime.node.state_dir import default_state_dir

    if (args.model is None) != (args.layers is None):
        raise ValueError("--model and --layers go together")
    if args.auto_join and args.model is not None:
        raise ValueError("--auto-join is for model-less nodes; --model pins one")
    if args.models is not None and not args.models.is_dir():
        raise ValueError(f"--models {args.models}: not a directory")
    serve = None
    if args.model is not None:
        serve = ServeOptions(
            model_dir=args.model.resolve(),
            layers=args.layers,
            recipe=args.recipe or DEFAULT_RECIPE,
            backend=args.backend,
            ttl_s=args.capability_ttl or DEFAULT_TTL_S,
            refresh_s=args.capability_refresh,
            max_sessions=args.max_sessions or DEFAULT_MAX_SESSIONS,
        )
    return NodeOptions(
        listen=args.listen,
        api=args.api,
        state_dir=args.state_dir or default_state_dir(),
        joins=tuple(args.join),
        profile=args.profile,
        data_listen=args.data_listen,
        advertise=args.advertise,
        fault_injection=args.fault_injection,
        encrypted=not args.insecure_plaintext,
        serve=serve,
        models=args.models.resolve() if args.models else None,
        backend=args.backend,
        auto_join=args.auto_join,
        recipe=args.recipe,
        max_memory=args.max_memory,
        swarm=args.swarm,
        invite=args.invite,
        max_chats_per_client=args.max_chats_per_client,
    )


def _configure_node_process(args: argparse.Namespace) -> None:
    """What a node process sets before it imports a backend: compute
    threads and their spin (COMPUTE_ENV_DEFAULTS), and logging on stderr."""
    import os

    for name, value in COMPUTE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _run_node(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _configure_node_process(args)
    try:
        options = node_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    serve = options.serve
    if serve is not None:
        from runtime.model.doctor import preflight

        checked = preflight(serve.model_dir, *serve.layers, serve.recipe, serve.backend)
        if not checked.admitted:
            print(f"{PROG} node: error: --model: {checked.message}", file=sys.stderr)
            return 2
    return _serve_node(options, "node")


def _run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`serve`: check the model (and fetch a hub model's metadata) before
    anything joins, then run a node that stocks its store with it and
    auto-joins (`runtime.node.provision`). `parser` is serve's own, so a
    usage error shows serve's usage."""
    from dataclasses import replace

    from runtime.model.backends.base import BackendError

    _configure_node_process(args)
    if args.model_dir is None and args.hub is None:
        parser.error("name a MODEL_DIR, or a hub model with --model hf:REPO[@REVISION]")
    try:
        options = node_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        provision = _serve_preflight(args)
    except _Unservable as exc:
        print(f"{PROG} serve: error: {exc}", file=sys.stderr)
        return 2
    except BackendError as exc:  # the hub could not give the model's files
        print(f"{PROG} serve: error: {exc}", file=sys.stderr)
        return 1
    return _serve_node(replace(options, provision=provision), "serve")


class _Unservable(Exception):
    """What `serve` refuses before it joins anything: a usage-like mistake."""


def _serve_preflight(args: argparse.Namespace) -> Provision:
    """What `serve` checks before it joins: the backend is installed, the
    folder is a model of a supported architecture (for a hub model, once
    its config, tokenizer and index are fetched: BackendError if they
    cannot be), and an existing manifest is readable. _Unservable says why not."""
    from runtime.model.doctor import backend_refusal
    from runtime.model.hub import HubModel
    from runtime.model.manifest import MANIFEST_FILE, ManifestError, load_manifest
    from runtime.model.progress import Progress
    from runtime.model.weights import SafetensorsReader, ShardLoadError, read_config
    from runtime.node.options import Provision

    refusal = backend_refusal(args.backend)
    if refusal is not None:
        raise _Unservable(refusal)
    folder = args.model_dir
    if args.hub is not None:
        folder = folder or default_hub_folder(args.hub)
        folder.mkdir(parents=True, exist_ok=True)
        with Progress(f"{PROG} serve") as progress:
            HubModel(args.hub, folder, progress=progress).fetch_metadata()
    elif not folder.is_dir():
        raise _Unservable(f"{folder}: no such model folder")
    try:
        read_config(folder)
        if args.hub is None:
            SafetensorsReader(folder)  # the weights are there (headers only)
        if (folder / MANIFEST_FILE).is_file():
            load_manifest(folder)
    except (ShardLoadError, ManifestError) as exc:
        raise _Unservable(str(exc)) from None
    return Provision(model_dir=folder.resolve(), hub=args.hub, name=args.name)


def default_hub_folder(source: HubSource) -> Path:
    """Where `serve --model hf:REPO@REVISION` puts the files without a
    MODEL_DIR: one folder per repository and revision in the user cache."""
    import platformdirs

    owner, name = source.repo.split("/", 1)
    return platformdirs.user_cache_path(PROG) / "hub" / owner / f"{name}@{source.revision}"


def _serve_node(options: NodeOptions, command: str) -> int:
    """Run the node until it stops; a start-up error is one line, exit 1."""
    import trio

    from mesh.identity import IdentityError
    from runtime.node.daemon import serve_node
    from runtime.node.options import NodeStartupError
    from runtime.node.state_dir import StateDirError

    try:
        trio.run(serve_node, options)
    except (StateDirError, IdentityError, NodeStartupError) as exc:
        print(f"{PROG} {command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    import trio

    from runtime.cli.chat_client import ChatClientError, ModelLoading, describe_loading, stream_chat

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def waiting(loading: ModelLoading, retry_in: float) -> None:
        print(
            f"{PROG} chat: waiting for {describe_loading(loading)} (asking again in "
            f"{retry_in:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    try:
        result = trio.run(
            lambda: stream_chat(
                args.api,
                args.model,
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                on_text=show,
                wait_s=args.wait,
                on_wait=waiting,
            )
        )
    except ChatClientError as exc:
        print(f"{PROG} chat: error: {exc}", file=sys.stderr)
        return 1
    print()
    if result.usage:
        print(
            f"[{result.finish_reason}; {result.usage['prompt_tokens']} prompt + "
            f"{result.usage['completion_tokens']} completion tokens{_chat_timing(result)}]",
            file=sys.stderr,
        )
    return 0


def _chat_timing(result: ChatResult) -> str:
    """ "; first token 28 ms, 9.1 ms/token through 3 hops", from the final
    chunk's `shardmesh.timing`, or nothing if the server sent no such figures
    (another OpenAI server, or a one-token answer)."""
    timing = (result.shardmesh or {}).get("timing")
    if not isinstance(timing, dict):
        return ""
    ttft, per_token, hops = (timing.get(k) for k in ("ttft_ms", "decode_ms_per_token", "hops"))
    if not (isinstance(ttft, int | float) and isinstance(per_token, int | float)):
        return ""
    through = f" through {len(hops)} hop{'s' * (len(hops) != 1)}" if isinstance(hops, list) else ""
    return f"; first token {ttft:.0f} ms, {per_token:.1f} ms/token{through}"


def _run_status(args: argparse.Namespace) -> int:
    from runtime.cli.status_view import StatusError, fetch_status, render

    try:
        status = fetch_status(args.api, timeout=args.timeout)
    except StatusError as exc:
        print(f"{PROG} status: error: {exc}", file=sys.stderr)
        return 1
    print(render(status, as_json=args.json))
    return 0


def _run_policy(args: argparse.Namespace) -> int:
    import json

    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, fetch_policy, render_policy, set_policy

    try:
        if args.settings:  # the leader's answer: the asked node may not have applied it yet
            token = find_token(args.token_file, args.state_dir)
            answer = set_policy(args.api, dict(args.settings), token=token, timeout=args.timeout)
        else:
            answer = fetch_policy(args.api, timeout=args.timeout)
    except (PolicyError, TokenError) as exc:
        print(f"{PROG} policy: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
        return 0
    if args.settings:
        print(f"committed at index {answer['index']} by leader {answer['leader'][:12]}")
    print(render_policy(answer["policy"], answer["settings"]))
    return 0


def _run_voters(args: argparse.Namespace) -> int:
    import json

    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, add_voter, fetch_voters, refound

    try:
        if args.voters_command == "add":
            token = find_token(args.token_file, args.state_dir)
            answer = add_voter(args.api, args.node_id, token=token, timeout=args.timeout)
        elif args.voters_command == "refound":
            token = find_token(args.token_file, args.state_dir)
            answer = refound(args.api, token=token, timeout=args.timeout)
        else:
            answer = fetch_voters(args.api, timeout=args.timeout)
    except (PolicyError, TokenError) as exc:
        print(f"{PROG} voters: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
    elif args.voters_command == "add":
        print(
            f"{args.node_id[:12]} may become a voter: committed at index {answer['index']} "
            f"by leader {answer['leader'][:12]}"
        )
    elif args.voters_command == "refound":
        print(
            f"refounded: {answer['voters'][0][:12]} is the only voter (entry {answer['index']}, "
            f"term {answer['term']}); the voter policy promotes eligible nodes from here"
        )
    else:
        for role in ("voters", "learners", "eligible"):
            print(f"{role:<9} {' '.join(n[:12] for n in answer[role]) or '-'}")
        if answer.get("eligibility_warning"):
            print(f"warning: {answer['eligibility_warning']}", file=sys.stderr)
    return 0


def _run_invite(args: argparse.Namespace) -> int:
    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, request_invitation

    try:
        token = find_token(args.token_file, args.state_dir)
        answer = request_invitation(args.api, voter=args.voter, expires_s=args.expires, token=token)
    except (PolicyError, TokenError) as exc:
        print(f"{PROG} invite: error: {exc}", file=sys.stderr)
        return 1
    print(answer["invitation"])
    role = "a voter-eligible member" if answer["voter"] else "a member"
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(answer["expires_at"]))
    print(
        f"lets one node join swarm {answer['swarm'][:12]} as {role} until {expires}: "
        f"{PROG} node --invite TOKEN ...",
        file=sys.stderr,
    )
    return 0


def _run_sweep(args: argparse.Namespace) -> int:
    from simulations.schema import ScenarioError
    from simulations.sweep import Setting, parse_seeds, run_sweep, write_csv

    try:
        seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
        settings = [Setting.parse(text) for text in args.set]
        runs = len(seeds) * math.prod(len(s.values) for s in settings)
        print(
            f"sweeping {args.scenario}: {runs} runs on {args.jobs} process(es) ...", file=sys.stderr
        )
        rows = run_sweep(args.scenario, seeds, settings, jobs=args.jobs)
    except ScenarioError as exc:
        print(f"{PROG} simulate: error: {args.scenario}: {exc}", file=sys.stderr)
        return 1
    write_csv(rows, args.csv if args.csv is not None else sys.stdout)
    if args.csv is not None:
        print(f"wrote {len(rows)} rows to {args.csv}", file=sys.stderr)
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    import json

    from simulations.report import plots_unavailable
    from simulations.scenario import ScenarioError, run_scenario

    if args.schema:
        from simulations.schema import render_schema

        print(render_schema(), end="")
        return 0
    if args.scenario is None:
        print(f"{PROG} simulate: error: name a SCENARIO.toml (or --schema)", file=sys.stderr)
        return 2
    if not args.scenario.is_file():
        print(f"{PROG} simulate: error: no scenario file at {args.scenario}", file=sys.stderr)
        return 1
    if args.seeds or args.set or args.csv:
        return _run_sweep(args)
    if not args.json:
        print(f"simulating {args.scenario} with seed {args.seed} ...", file=sys.stderr)
    timeline: list[str] | None = [] if args.out is not None else None
    plots = args.out
    if plots is not None and (why := plots_unavailable()) is not None:
        print(f"{PROG} simulate: warning: no plots: {why}", file=sys.stderr)
        plots = None
    try:
        result = run_scenario(args.scenario, args.seed, timeline, plots)
    except ScenarioError as exc:
        print(f"{PROG} simulate: error: {args.scenario}: {exc}", file=sys.stderr)
        return 1
    document = json.dumps(result, indent=None if args.json else 2)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "metrics.json").write_text(document + "\n")
        lines = "".join(f"{line}\n" for line in timeline or ())
        (args.out / "timeline.txt").write_text(lines)
    print(document)
    return 0


def _run_tiny_model(args: argparse.Namespace) -> int:
    from runtime.model.backends.base import BackendError
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
        print(f"{PROG} tiny-model: error: {exc}", file=sys.stderr)
        return 1
    print(out)
    print(digest)
    return 0


def _run_manifest_build(args: argparse.Namespace) -> int:
    from runtime.model.backends.base import BackendError
    from runtime.model.manifest import build_manifest, manifest_digest
    from runtime.model.progress import Progress

    if not args.dir.is_dir():
        print(f"{PROG} manifest build: error: no directory at {args.dir}", file=sys.stderr)
        return 1
    try:
        with Progress(f"{PROG} manifest build") as progress:
            manifest = build_manifest(args.dir, name=args.name, progress=progress)
    except (OSError, BackendError) as exc:
        print(f"{PROG} manifest build: error: {exc}", file=sys.stderr)
        return 1
    print(manifest_digest(manifest))
    return 0


def _run_doctor(args: argparse.Namespace) -> int:
    from runtime.model.doctor import render_text, run_doctor
    from runtime.model.progress import Progress

    start, end = args.layers
    with Progress(f"{PROG} doctor") as progress:
        report = run_doctor(
            args.model,
            start,
            end,
            args.recipe,
            args.backend,
            measure=not args.no_measure,
            progress=progress,
        )
    print(report.to_json() if args.json else render_text(report))
    if not report.admitted:
        print(f"{PROG} doctor: refused: {report.reason}: {report.message}", file=sys.stderr)
        return 1
    return 0


def parse_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """`parser.parse_args`, with `node --config FILE`'s (or `serve`'s)
    values as defaults (so flags still win); a bad file exits 2 with one
    line, as a usage error."""
    from runtime.cli.config_file import ConfigError, apply_config

    argv = sys.argv[1:] if argv is None else list(argv)
    for command in NODE_COMMANDS:
        try:
            apply_config(parser, build_parser, argv, command)
        except ConfigError as exc:
            parser.exit(2, f"{PROG} {command}: error: {exc}\n")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardmesh` console script; returns the exit code."""
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if args.command == "node":
        return _run_node(args, parser)
    if args.command == "serve":
        from runtime.cli.config_file import subcommand

        return _run_serve(args, subcommand(parser, "serve"))
    if args.command == "status":
        return _run_status(args)
    if args.command == "chat":
        return _run_chat(args)
    if args.command == "simulate":
        return _run_simulate(args)
    if args.command == "policy":
        return _run_policy(args)
    if args.command == "invite":
        return _run_invite(args)
    if args.command == "voters":
        return _run_voters(args)
    if args.command == "tiny-model":
        return _run_tiny_model(args)
    if args.command == "manifest":
        return _run_manifest_build(args)
    if args.command == "doctor":
        return _run_doctor(args)
    if args.command == "demo":
        from runtime.cli.demo import run_demo

        if args.nodes < 2:
            parser.error("demo needs at least 2 nodes (one is killed)")
        return run_demo(nodes=args.nodes, profile=args.profile, keep=args.keep)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
