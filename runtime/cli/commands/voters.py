"""`shardmesh voters`: who votes in the swarm's Raft (`list`), making a node
eligible to (`add`), and refounding a swarm whose voters are gone (`refound`).

`add` and `refound` change the swarm and need the asked node's operator
token (`runtime.cli.flags.token_flags`); each subcommand has its own run
function.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from runtime.cli import argtypes
from runtime.cli.command import Commands, fail
from runtime.cli.flags import api_flag, token_flags

REFOUND_HELP = (
    "When the voters are gone for good (a founder that died before anyone was "
    "promoted, or voters lost past recovery) the swarm has no leader, ever. This "
    "makes the node at --api the only voter and its leader; the voter policy then "
    "promotes eligible nodes again. Entries that only the lost voters held are "
    "lost, so run it on the surviving eligible node with the longest log "
    "(`shardmesh status` shows raft.last_index). The node refuses until it has had "
    "no leader for the profile's dead-voter grace. Needs that node's own operator "
    "token (--token-file, --state-dir or SHARDMESH_TOKEN)."
)


def register(commands: Commands) -> None:
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
    listing = voters_commands.add_parser(
        "list", help="who votes, who learns, who may vote", description="Show the voters."
    )
    add = voters_commands.add_parser(
        "add",
        help="make NODE_ID eligible to vote (committed in the ledger)",
        description=(
            "Commit that NODE_ID may become a voter; the leader promotes it once it is "
            "stable. Needs the asked node's operator token (--token-file, --state-dir or "
            "SHARDMESH_TOKEN)."
        ),
    )
    add.add_argument("node_id", type=argtypes.node_id, metavar="NODE_ID", help="the node's id")
    token_flags(add)
    refound = voters_commands.add_parser(
        "refound",
        help="make the node at --api the only voter (the voters are gone for good)",
        description=REFOUND_HELP,
    )
    token_flags(refound)
    for sub, run in ((listing, run_list), (add, run_add), (refound, run_refound)):
        api_flag(sub, "any node's API")
        sub.add_argument("--json", action="store_true", help="print the raw JSON answer")
        sub.add_argument(
            "--timeout",
            type=argtypes.seconds,
            default=10.0,
            help="seconds to wait for an answer, and for a leader while one is elected",
        )
        sub.set_defaults(run=run)


def run_list(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.policy_client import PolicyError, fetch_voters  # httpx: only when asked

    try:
        answer = fetch_voters(args.api, timeout=args.timeout)
    except PolicyError as exc:
        return fail("voters", str(exc))
    if args.json:
        return _print_json(answer)
    for role in ("voters", "learners", "eligible"):
        print(f"{role:<9} {' '.join(n[:12] for n in answer[role]) or '-'}")
    if answer.get("eligibility_warning"):
        print(f"warning: {answer['eligibility_warning']}", file=sys.stderr)
    return 0


def run_add(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, add_voter  # httpx: only when asked

    try:
        token = find_token(args.token_file, args.state_dir)
        answer = add_voter(args.api, args.node_id, token=token, timeout=args.timeout)
    except (PolicyError, TokenError) as exc:
        return fail("voters", str(exc))
    if args.json:
        return _print_json(answer)
    print(
        f"{args.node_id[:12]} may become a voter: committed at index {answer['index']} "
        f"by leader {answer['leader'][:12]}"
    )
    return 0


def run_refound(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, refound  # httpx: only when asked

    try:
        token = find_token(args.token_file, args.state_dir)
        answer = refound(args.api, token=token, timeout=args.timeout)
    except (PolicyError, TokenError) as exc:
        return fail("voters", str(exc))
    if args.json:
        return _print_json(answer)
    print(
        f"refounded: {answer['voters'][0][:12]} is the only voter (entry {answer['index']}, "
        f"term {answer['term']}); the voter policy promotes eligible nodes from here"
    )
    return 0


def _print_json(answer: dict[str, Any]) -> int:
    print(json.dumps(answer, indent=2, sort_keys=True))
    return 0
