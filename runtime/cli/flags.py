"""The flag groups that several `shardmesh` commands share, each defined once.

`node_flags`: what `node` and `serve` share, so a flag means the same in
both commands and in both commands' `--config` files. `token_flags`: where
an admin command (`policy`, `voters`, `invite`) finds the node's operator
token. `api_flag`: the `--api URL` of a command that talks to a running node.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from runtime.cli import argtypes
from runtime.node.hostport import HostPort

NODE_COMMANDS: Final = ("node", "serve")
"""The commands that run a node: they share its flags and `--config FILE`."""
SERVE_LISTEN: Final = HostPort("127.0.0.1", 0)
"""`serve` without --listen: a free port on loopback. Safe by default (no
one else can reach the node); a volunteer serving others passes
`--listen 0.0.0.0:PORT --advertise THEIR_ADDRESS`, as for `node`."""


def node_flags(parser: argparse.ArgumentParser, *, command: str) -> None:
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
    _address_flags(parser, serving=command == "serve")
    _swarm_flags(parser)
    _compute_flags(parser)
    _process_flags(parser)


def _address_flags(parser: argparse.ArgumentParser, *, serving: bool) -> None:
    """Where the node listens, whom it joins, and what it tells peers to dial."""
    parser.add_argument(
        "--listen",
        required=not serving,
        default=SERVE_LISTEN if serving else None,
        type=argtypes.hostport,
        metavar="H:P",
        help="control-plane (membership) address; port 0 picks a free port"
        + (f" (default {SERVE_LISTEN.text()}: this machine only)" if serving else ""),
    )
    parser.add_argument(
        "--join",
        action="append",
        default=[],
        type=argtypes.seed,
        metavar="ID@H:P",
        help="id and control address of any node already in the swarm, as it prints "
        "them at start (repeatable)",
    )
    parser.add_argument(
        "--api",
        type=argtypes.hostport,
        default=None,
        metavar="H:P",
        help="HTTP API address (default: a free port on 127.0.0.1, or with --advertise on "
        "the --listen host, so the advertised API is reachable; see the log line)",
    )
    parser.add_argument(
        "--data-listen",
        type=argtypes.hostport,
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
        "--no-relay",
        action="store_true",
        help="do not relay for nodes behind NAT (a reachable node does by default, at its "
        "control port + 100)",
    )
    parser.add_argument(
        "--relay-port",
        type=argtypes.positive_int,
        default=None,
        metavar="P",
        help="the port nodes behind NAT reserve relayed addresses at (default: the control "
        "port + 100)",
    )


def _swarm_flags(parser: argparse.ArgumentParser) -> None:
    """Where the node keeps its identity; the swarm it founds or joins."""
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


def _compute_flags(parser: argparse.ArgumentParser) -> None:
    """What the node computes with, and how much of it it offers."""
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
        type=argtypes.size,
        default=None,
        metavar="SIZE",
        help="the most memory this node gives a shard, weights and KV caches together, "
        "e.g. 8G or 512M: placement sizes shards by it, and a session whose cache would "
        "not fit is turned away (default: what is free when it starts)",
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
        type=argtypes.positive_int,
        default=None,
        metavar="N",
        help="chats one HTTP client (one IP address, an IPv6 /64) may run at once on this "
        "node; more get 429 (default 4; behind a reverse proxy all clients share one)",
    )
    parser.add_argument(
        "--threads",
        type=argtypes.positive_int,
        default=None,
        metavar="N",
        help="CPU threads for the torch backend (default: all cores; 1 when several "
        "nodes share one machine)",
    )


def _process_flags(parser: argparse.ArgumentParser) -> None:
    """Switches on the node process itself: test hooks, benchmarks, logging."""
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


def token_flags(command: argparse.ArgumentParser) -> None:
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


def api_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """`--api URL` (required): the running node the command asks."""
    parser.add_argument("--api", required=True, type=argtypes.url, metavar="URL", help=help)
