"""`shardmesh policy`: show the swarm's placement policy, or change its knobs.

A change goes to any node, which forwards it to the Raft leader; the leader
commits every `--set` in one entry for the whole swarm. Changing needs the
asked node's operator token (`runtime.cli.flags.token_flags`).
"""

from __future__ import annotations

import argparse

from runtime.cli import argtypes
from runtime.cli.command import Commands, fail
from runtime.cli.flags import api_flag, token_flags


def register(commands: Commands) -> None:
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
    api_flag(policy, "any node's API")
    policy.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        type=argtypes.setting,
        metavar="NAME=VALUE",
        help="change a knob, e.g. idle_release_s=600 (repeatable; one commit for all)",
    )
    policy.add_argument("--json", action="store_true", help="print the raw JSON answer")
    token_flags(policy)
    policy.add_argument(
        "--timeout",
        type=argtypes.seconds,
        default=10.0,
        help="seconds to wait for an answer, and for a leader while one is elected (default 10)",
    )
    policy.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json

    # httpx (the policy client's): only when asked
    from runtime.cli.operator_token import TokenError, find_token
    from runtime.cli.policy_client import PolicyError, fetch_policy, render_policy, set_policy

    try:
        if args.settings:  # the leader's answer: the asked node may not have applied it yet
            token = find_token(args.token_file, args.state_dir)
            answer = set_policy(args.api, dict(args.settings), token=token, timeout=args.timeout)
        else:
            answer = fetch_policy(args.api, timeout=args.timeout)
    except (PolicyError, TokenError) as exc:
        return fail("policy", str(exc))
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
        return 0
    if args.settings:
        print(f"committed at index {answer['index']} by leader {answer['leader'][:12]}")
    print(render_policy(answer["policy"], answer["settings"]))
    return 0
