"""`shardmesh invite`: a token that lets one node (or `--uses N` nodes) join a private swarm.

A voter of the swarm signs it; whoever holds it can join (`shardmesh node
--invite TOKEN`) until it expires or has admitted as many nodes as it says
(the ledger counts), so it is handed over privately. A voter's invitation
lets one node in and expires sooner (`runtime.node.access`). Asking for
one needs the node's operator token (`runtime.cli.flags.token_flags`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from runtime.cli import argtypes
from runtime.cli.command import PROG, Commands, fail
from runtime.cli.flags import api_flag, token_flags


def register(commands: Commands) -> None:
    invite = commands.add_parser(
        "invite",
        help="invite a node to a private swarm (prints a token for its --invite)",
        description=(
            "Ask a voter of a private swarm for an invitation: a token, signed by that "
            "voter, that lets ONE node join with `shardmesh node --invite TOKEN`, once, "
            "until it expires (--uses N: N nodes, each once). Whoever holds it can join: "
            "hand it over privately. Needs the node's operator token (--token-file, "
            "--state-dir or SHARDMESH_TOKEN)."
        ),
    )
    api_flag(invite, "a voter's API")
    invite.add_argument(
        "--voter",
        action="store_true",
        help="the newcomer may become a voter (it is eligible, and can then invite too); "
        "such a token lets one node in and expires within a day (default 1h)",
    )
    invite.add_argument(
        "--uses",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="how many nodes the token lets join, each once (default 1; a voter's: 1)",
    )
    invite.add_argument(
        "--expires",
        type=argtypes.duration,
        default=None,
        metavar="DURATION",
        help="how long the token stays redeemable, e.g. 30m, 24h, 7d "
        "(default 24h, or 1h with --voter)",
    )
    token_flags(invite)
    invite.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, request_invitation  # httpx: only when asked

    if args.voter and args.uses != 1:
        parser.error("a voter's invitation lets one node in: --voter takes no --uses")
    try:
        token = find_token(args.token_file, args.state_dir)
        answer = request_invitation(
            args.api, voter=args.voter, expires_s=args.expires, uses=args.uses, token=token
        )
    except (PolicyError, TokenError) as exc:
        return fail("invite", str(exc))
    print(answer["invitation"])
    print(f"{what_it_does(answer)}: {PROG} node --invite TOKEN ...", file=sys.stderr)
    return 0


def what_it_does(answer: dict[str, Any]) -> str:
    """What the token lets happen, in words: how many nodes, as what, until when."""
    uses = answer.get("uses", 1)
    role = "voter-eligible member" if answer["voter"] else "member"
    until = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(answer["expires_at"]))
    swarm = answer["swarm"][:12]
    if uses == 1:
        return f"lets ONE node join swarm {swarm} as a {role}, once, until {until}"
    return f"lets {uses} nodes join swarm {swarm} as {role}s, each once, until {until}"
