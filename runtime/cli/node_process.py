"""What `node` and `serve` share once their flags are parsed: the
`NodeOptions` the flags ask for, the process' compute and logging setup,
and running the node until it stops.

The daemon, trio and the compute backends are imported only in
`run_node`, when a node actually starts: building the parser (and
`shardmesh --help`) must not pay for them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Final

from runtime.cli.command import fail
from runtime.cli.model_source import model_folder

if TYPE_CHECKING:
    from runtime.node.options import NodeOptions

COMPUTE_ENV_DEFAULTS: Final = {"GOMP_SPINCOUNT": "20000"}
"""Set before torch loads (libgomp reads it once). A node computes in bursts
between network waits. libgomp's default spin (300,000 iterations) keeps
idle workers burning the cores the node's event loop, and any node beside
it, needs next (measured on loopback: 11 ms per hop); never spinning
(OMP_WAIT_POLICY=PASSIVE) re-wakes the workers at every parallel region of
a forward. A short spin keeps them warm within a forward and asleep between
steps (measured: ~0.9-1.5 ms per hop). An operator's own setting wins."""


def node_options(args: argparse.Namespace) -> NodeOptions:
    """The options a `node` or `serve` command line (and its --config file)
    asks for; starts nothing and fetches nothing (a hub model's folder is
    where its files will be). A combination of flags that cannot work
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
    state_dir = args.state_dir or default_state_dir()
    if args.model is not None:
        serve = ServeOptions(
            model_dir=model_folder(args.model, state_dir).resolve(),
            layers=args.layers,
            recipe=args.recipe or DEFAULT_RECIPE,
            backend=args.backend,
            ttl_s=args.capability_ttl or DEFAULT_TTL_S,
            refresh_s=args.capability_refresh,
            max_sessions=args.max_sessions or DEFAULT_MAX_SESSIONS,
            max_memory=args.max_memory,
        )
    return NodeOptions(
        listen=args.listen,
        api=args.api,
        state_dir=state_dir,
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
        relay=not args.no_relay,
        relay_port=args.relay_port,
    )


def configure_node_process(args: argparse.Namespace) -> None:
    """What a node process sets before it imports a backend: compute
    threads and their spin (COMPUTE_ENV_DEFAULTS), and logging on stderr."""
    for name, value in COMPUTE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_node(options: NodeOptions, command: str) -> int:
    """Run the node until it stops; a start-up error is one line, exit 1."""
    import trio

    from mesh.identity import IdentityError
    from runtime.node.daemon import serve_node
    from runtime.node.options import NodeStartupError
    from runtime.node.state_dir import StateDirError

    try:
        trio.run(serve_node, options)
    except (StateDirError, IdentityError, NodeStartupError) as exc:
        return fail(command, str(exc))
    return 0
