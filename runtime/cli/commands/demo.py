"""`shardmesh demo` (what `make demo` runs): its flags; the demo itself is `runtime.cli.demo`."""

from __future__ import annotations

import argparse

from runtime.cli.command import Commands


def register(commands: Commands) -> None:
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
    demo.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.demo import run_demo  # trio and the local swarm: only for the demo

    if args.nodes < 2:
        parser.error("demo needs at least 2 nodes (one is killed)")
    return run_demo(nodes=args.nodes, profile=args.profile, keep=args.keep)
