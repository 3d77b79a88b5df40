"""`shardmesh status`: a node's view of the swarm (GET /v1/network/status), printed."""

from __future__ import annotations

import argparse

from runtime.cli.command import Commands, fail
from runtime.cli.flags import api_flag


def register(commands: Commands) -> None:
    status = commands.add_parser(
        "status",
        help="show a node's view of the swarm",
        description="Fetch GET /v1/network/status from a node and print it.",
    )
    api_flag(status, "the node's API, http://H:P or H:P")
    status.add_argument("--json", action="store_true", help="print the raw JSON document")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    status.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.status_view import StatusError, fetch_status, render  # httpx

    try:
        status = fetch_status(args.api, timeout=args.timeout)
    except StatusError as exc:
        return fail("status", str(exc))
    print(render(status, as_json=args.json))
    return 0
