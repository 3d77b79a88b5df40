"""`shardmesh invite`: a token that lets one node join a private swarm.

A voter of the swarm signs it; whoever holds it can join (`shardmesh node
--invite TOKEN`) until it expires, so it is handed over privately. Asking
for one needs the node's operator token (`runtime.cli.flags.token_flags`).
"""

from __future__ import annotations

import argparse
import sys
import time

from runtime.cli import argtypes
from runtime.cli.command import PROG, Commands, fail
from runtime.cli.flags import api_flag, token_flags


def register(commands: Commands) -> None:
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
    api_flag(invite, "a voter's API")
    invite.add_argument(
        "--voter",
        action="store_true",
        help="the newcomer may become a voter (it is eligible, and can then invite too)",
    )
    invite.add_argument(
        "--expires",
        type=argtypes.duration,
        default=24 * 3600.0,
        metavar="DURATION",
        help="how long the token stays redeemable, e.g. 30m, 24h, 7d (default 24h)",
    )
    token_flags(invite)
    invite.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, request_invitation  # httpx: only when asked

    try:
        token = find_token(args.token_file, args.state_dir)
        answer = request_invitation(args.api, voter=args.voter, expires_s=args.expires, token=token)
    except (PolicyError, TokenError) as exc:
        return fail("invite", str(exc))
    print(answer["invitation"])
    role = "a voter-eligible member" if answer["voter"] else "a member"
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(answer["expires_at"]))
    print(
        f"lets one node join swarm {answer['swarm'][:12]} as {role} until {expires}: "
        f"{PROG} node --invite TOKEN ...",
        file=sys.stderr,
    )
    return 0
