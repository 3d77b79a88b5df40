"""Ledger reach benchmark: the leader's Raft traffic in a swarm whose
configuration the voter policy built, beside a 5-voter cluster alone and
beside the old rule (every member a learner); and the spread of the
leader's ledger notice through gossip, beside the gossip target.

    python -m benchmarks.ledger_reach [--json] [--quick] [--seed N]

Real `RaftNode` cores and real membership cores in the simulator, 1,000 and
10,000 members of which a dozen are eligible to vote. `--quick` shortens the
window and skips the 10,000-member old-rule run (minutes). The last line
printed is one JSON object; what each key means:
docs/benchmarks.md#ledger_reach.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from consensus.codec import MAX_ENTRY_DATA_BYTES
from consensus.config import ConsensusConfig
from consensus.raft import encode_config
from mesh.identity import node_id_text
from runtime.node.record_publisher import NOTICE_INTERVAL_S
from simulations.ledger_reach import (
    LeaderTraffic,
    NoticeSpread,
    PolicySwarm,
    await_leader,
    leader_traffic,
    member_ids,
    notice_spread,
    old_rule_cluster,
    voters_only_cluster,
    workload,
)

ELIGIBLE = 12
"""Eligible nodes in the swarm: the founder and eleven an operator trusts,
more than the 5 voters and 4 learners the policy lets into Raft."""
VOTERS = 5
WINDOW_COMMANDS = 80
"""20 s of workload at one command per 0.25 s: 400 heartbeats."""
QUICK_WINDOW_COMMANDS = 40
OLD_RULE_COMMANDS = {1000: 8, 10000: 4}
"""The old rule's windows (2 s and 1 s): each of its learners is a real core."""
WARM_S = 2.0
"""After the configuration settles: the last learner has caught up."""
RATIO_TARGET = 2.0
SPREAD_TARGET_S = {1000: 2.0, 10000: 2.2}
"""The gossip targets, from serf's analytic convergence model of memberlist
(fanout 3, 200 ms rounds): 99.9% of 1,000 nodes in 2.0 s, of 10,000 in 2.2 s
(`benchmarks.gossip` measures the same)."""


def _traffic(run: LeaderTraffic, baseline: LeaderTraffic | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "msgs_per_s": round(run.per_s, 1),
        "sent_per_s": round(run.sent_per_s, 1),
        "received_per_s": round(run.received_per_s, 1),
        "window_s": round(run.window_s, 3),
        "leader_s": round(run.leader_s, 3),
        "leaders": run.leaders,
        "peers_messaged": run.peers_messaged,
        "proposed": run.proposed,
        "committed": run.committed,
        "queue_drops": run.queue_drops,
    }
    if baseline is not None:
        out["ratio"] = round(run.per_s / baseline.per_s, 4)
    return out


def _spread(spread: NoticeSpread, target_s: float) -> dict[str, Any]:
    p999 = spread.quantile(0.999)
    return {
        "nodes": spread.nodes,
        "record_body_bytes": spread.body_bytes,
        "p50_s": round(spread.quantile(0.5), 4),
        "p99_s": round(spread.quantile(0.99), 4),
        "p999_s": round(p999, 4),
        "max_s": round(spread.times[-1], 4) if spread.times else None,
        "reached_fraction": round(spread.reached, 5),
        "verified_fraction": round(spread.verified / spread.nodes, 5),
        "assigned_node_s": None if spread.target_s is None else round(spread.target_s, 4),
        "target_s": target_s,
        "within_target": p999 <= target_s,
    }


@dataclass
class _Results:
    """What the runs measured, filled in as they go: each run's detail by
    name, and its wall seconds."""

    say: Callable[[str], None]
    raft: dict[str, Any] = field(default_factory=dict)
    spread: dict[str, Any] = field(default_factory=dict)
    reach: dict[str, Any] = field(default_factory=dict)
    walls: dict[str, float] = field(default_factory=dict)
    config_entry_bytes: int = 0


def _baseline_run(seed: int, commands: list[bytes], results: _Results) -> LeaderTraffic:
    """The workload on a 5-voter cluster alone: what the ratios divide by."""
    results.say(f"raft: {VOTERS} voters alone, {len(commands)} commands ...")
    t0 = time.perf_counter()
    base_cluster = voters_only_cluster(seed, voters=VOTERS)
    await_leader(base_cluster)
    baseline = leader_traffic(base_cluster, commands)
    results.raft["baseline_5_voters"] = _traffic(baseline, None)
    results.walls["baseline"] = time.perf_counter() - t0
    results.say(f"  {json.dumps(results.raft['baseline_5_voters'])}")
    return baseline


def _policy_run(
    members: int, seed: int, commands: list[bytes], baseline: LeaderTraffic, results: _Results
) -> None:
    """A swarm whose configuration the voter policy built: the leader's
    traffic under the workload, then one assignment's notice spreading."""
    results.say(f"raft: {members} members, {ELIGIBLE} eligible, policy-built configuration ...")
    t0 = time.perf_counter()
    swarm = PolicySwarm(members, ELIGIBLE, seed)
    swarm.found()
    voters, learners = swarm.settle()
    settled_at = swarm.raft.now
    swarm.raft.run_for(WARM_S)
    run = leader_traffic(swarm.raft, commands)
    detail = _traffic(run, baseline)
    detail.update(
        voters=len(voters),
        learners=len(learners),
        config_changes=[c.kind for _, c in swarm.decisions],
        settled_at_s=round(settled_at, 3),
        config_entry_bytes=len(encode_config(voters, learners)),
    )
    results.config_entry_bytes = max(results.config_entry_bytes, detail["config_entry_bytes"])
    results.raft[f"policy_{members}"] = detail
    results.say(f"  {json.dumps(detail)}")

    previous = swarm.notice()
    target = swarm.ids[-1]
    proposal = swarm.assign(target)
    commit_s = swarm.raft.committed[proposal.index].at - proposal.at
    notice = swarm.notice()
    named = node_id_text(target) in {node for node, _ in notice.changed}
    results.walls[f"raft_{members}"] = time.perf_counter() - t0

    results.say(f"notice spread: {members} nodes ...")
    t0 = time.perf_counter()
    spread = notice_spread(members, seed, notice, previous=previous, target=members - 1)
    key = str(members)
    results.spread[key] = _spread(spread, SPREAD_TARGET_S[members])
    results.spread[key]["notice_names_assigned_node"] = named
    results.walls[f"spread_{members}"] = time.perf_counter() - t0
    results.say(f"  {json.dumps(results.spread[key])}")
    results.reach[key] = {
        "commit_ms": round(commit_s * 1000, 3),
        "notice_interval_s": NOTICE_INTERVAL_S,
        "spread_p999_s": results.spread[key]["p999_s"],
        "reach_p999_s": round(commit_s + NOTICE_INTERVAL_S + spread.quantile(0.999), 4),
    }


def _old_rule_run(
    members: int, seed: int, commands: list[bytes], baseline: LeaderTraffic, results: _Results
) -> None:
    """The rule the voter policy replaced: 5 voters, every other member a learner."""
    results.say(f"raft, old rule: {members} members all learners ({members - VOTERS}) ...")
    t0 = time.perf_counter()
    cluster = old_rule_cluster(members, seed, voters=VOTERS)
    await_leader(cluster)
    elected_at = cluster.now
    old_run = leader_traffic(cluster, commands[: OLD_RULE_COMMANDS[members]])
    detail = _traffic(old_run, baseline)
    detail.update(
        learners=members - VOTERS,
        elected_at_s=round(elected_at, 3),
        terms=max(cluster.term(i) for i in range(VOTERS)),
        config_entry_bytes=len(
            encode_config(
                frozenset(cluster.nodes[i].node_id for i in range(VOTERS)),
                frozenset(cluster.nodes[i].node_id for i in range(VOTERS, members)),
            )
        ),
    )
    results.raft[f"old_rule_{members}"] = detail
    results.walls[f"old_rule_{members}"] = time.perf_counter() - t0
    results.say(f"  {json.dumps(detail)}")


def _result_json(results: _Results, window: int, seed: int, started: float) -> dict[str, Any]:
    """The benchmark's JSON object: the headline figures, then every run's detail."""
    raft, spread = results.raft, results.spread
    ratio = raft["policy_1000"]["ratio"]
    within = all(s["within_target"] for s in spread.values())
    old_10000 = raft.get("old_rule_10000")
    return {
        "benchmark": "ledger_reach",
        "members": 1000,
        "eligible": ELIGIBLE,
        "voters": raft["policy_1000"]["voters"],
        "learners": raft["policy_1000"]["learners"],
        "leader_raft_msgs_per_s": raft["policy_1000"]["msgs_per_s"],
        "baseline_leader_raft_msgs_per_s": raft["baseline_5_voters"]["msgs_per_s"],
        "leader_raft_msgs_ratio": ratio,
        "leader_raft_msgs_ratio_10000": raft["policy_10000"]["ratio"],
        "old_rule_leader_raft_msgs_ratio_1000": raft["old_rule_1000"]["ratio"],
        "old_rule_leader_raft_msgs_ratio_10000": None if old_10000 is None else old_10000["ratio"],
        "notice_spread_p999_s_1000": spread["1000"]["p999_s"],
        "notice_spread_p999_s_10000": spread["10000"]["p999_s"],
        "notice_spread_target_s": {str(k): v for k, v in SPREAD_TARGET_S.items()},
        "notice_spread_within_target": within,
        "assignment_reach_p999_s_1000": results.reach["1000"]["reach_p999_s"],
        "config_entry_bytes": results.config_entry_bytes,
        "config_entry_cap_bytes": MAX_ENTRY_DATA_BYTES,
        "targets_met": {
            "leader_ratio_le_2": ratio <= RATIO_TARGET
            and raft["policy_10000"]["ratio"] <= RATIO_TARGET,
            "notice_spread_within_target": within,
            "notice_names_assigned_node": all(
                s["notice_names_assigned_node"] for s in spread.values()
            ),
        },
        "raft": raft,
        "spread": spread,
        "reach": results.reach,
        "workload": {
            "interval_s": 0.25,
            "commands": window,
            "heartbeat_s": ConsensusConfig.lan().tick_s,
        },
        "note": "Raft: leader's messages sent+received per second of leading, real RaftNode "
        "cores in virtual time; policy_*: the voter policy built the configuration from "
        "every member's view (only eligible nodes run Raft). spread: real membership cores, "
        "the leader's real NodeRecord with the notice, 99.9% of nodes holding it; the HTTP "
        "pull after it is not simulated.",
        "seed": seed,
        "wall_s_by_run": {k: round(v, 1) for k, v in results.walls.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="shorter window; no 10,000-member old-rule run"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    seed = args.seed

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    window = QUICK_WINDOW_COMMANDS if args.quick else WINDOW_COMMANDS
    ids = member_ids(seed, 1000)
    commands = workload(ids[ELIGIBLE:-1], window)
    results = _Results(say)
    baseline = _baseline_run(seed, commands, results)
    for members in (1000, 10000):
        _policy_run(members, seed, commands, baseline, results)
    for members in (1000,) if args.quick else (1000, 10000):
        _old_rule_run(members, seed, commands, baseline, results)
    print(json.dumps(_result_json(results, window, seed, started)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
