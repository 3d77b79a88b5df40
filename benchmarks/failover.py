"""Leader failover benchmark: the real Raft core in the simulator, side by
side with the Raft thesis (ch. 9: 5 servers, 150-300 ms election timeouts,
median failover 287 ms, worst 513 ms).

    python -m benchmarks.failover [--json] [--runs N] [--real-trials N]

Simulated: a 5-voter `RaftCluster` loses its leader at a random moment, and
the clock runs until a new leader has committed an entry of its own term;
then the commit rate an open-loop load gets within a latency bound. Real:
5 `shardmesh node` processes on loopback, the leader SIGKILLed, until a
survivor's API commits in a newer term. The last line printed is one JSON
object; what each key means: docs/benchmarks.md#failover.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from simulations.raft_cluster import Proposal, RaftCluster
from simulations.seeds import component_rng

VOTERS = 5
TICK_S = 0.015
ELECTION_TICKS = 10
THESIS_MEDIAN_MS = 287
THESIS_WORST_MS = 513
TARGET_MEDIAN_MS = 300
TARGET_MAX_MS = 600
WARM_ENTRIES = 3
"""Entries committed before the crash, so the new leader has a log to match."""
CRASH_WINDOW_S = 0.5
"""The crash lands uniformly in this window after the warm-up commits:
several heartbeats, so every phase of the followers' timers is sampled."""
GIVE_UP_S = 10.0
ASSIGN_PATH = "/v1/nodes/assign"
LOAD_INTERVALS_S = (0.004, 0.002, 0.001, 0.0005)
LOAD_DURATION_S = 5.0
LATENCY_BOUND_MS = 60.0
"""Four heartbeats: a commit slower than that at p99 means queues, not Raft."""


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile: the value at or below which a fraction q lies."""
    rank = max(1, min(len(sorted_values), round(q * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def _await_stable_leader(cluster: RaftCluster) -> int:
    """Run until some leader has committed in its own term; return it."""

    def unsettled() -> bool:
        i = cluster.leader()
        return i is None or cluster.term(i) not in cluster.first_commit_in_term

    if cluster.run_while(unsettled, GIVE_UP_S):
        raise RuntimeError(f"seed {cluster.seed}: no leader could commit in {GIVE_UP_S} s")
    leader = cluster.leader()
    assert leader is not None
    return leader


def failover_run(seed: int) -> dict[str, float]:
    """One crash of a stable leader; times in ms from the crash."""
    cluster = RaftCluster(VOTERS, seed, tick_s=TICK_S, election_ticks=ELECTION_TICKS)
    _await_stable_leader(cluster)
    for n in range(WARM_ENTRIES):
        proposal = cluster.propose(b"warm-%d" % n)
        if proposal is None or not _await_commit(cluster, proposal):
            raise RuntimeError(f"seed {seed}: warm-up entry {n} did not commit")
    cluster.run_for(component_rng(seed, "bench", "crash").random() * CRASH_WINDOW_S)
    old = cluster.leader()
    assert old is not None
    old_term = cluster.term(old)
    cluster.crash(old)
    crashed_at = cluster.now

    def waiting() -> bool:
        return not any(term > old_term for term in cluster.first_commit_in_term)

    if cluster.run_while(waiting, GIVE_UP_S):
        raise RuntimeError(f"seed {seed}: no new leader committed in {GIVE_UP_S} s")
    new_term = min(t for t in cluster.first_commit_in_term if t > old_term)
    cluster.check_safety()
    return {
        "failover_ms": (cluster.first_commit_in_term[new_term] - crashed_at) * 1000,
        "election_ms": (cluster.elected_at[new_term] - crashed_at) * 1000,
        "terms": new_term - old_term,
    }


def _await_commit(cluster: RaftCluster, proposal: Proposal) -> bool:
    return not cluster.run_while(lambda: not cluster.is_committed(proposal), GIVE_UP_S)


def throughput_run(interval_s: float, seed: int = 0) -> dict[str, float]:
    """Open-loop steady load on a healthy cluster (see module doc)."""
    cluster = RaftCluster(VOTERS, seed, tick_s=TICK_S, election_ticks=ELECTION_TICKS)
    _await_stable_leader(cluster)
    proposals: list[Proposal] = []
    start = cluster.now
    stop = start + LOAD_DURATION_S
    counter = iter(range(1 << 62))

    def offer() -> None:
        if cluster.now >= stop:
            return
        proposal = cluster.propose(b"load-%d" % next(counter))
        if proposal is not None:
            proposals.append(proposal)
        cluster.loop.call_later(interval_s, offer)

    wall = time.perf_counter()
    cluster.loop.call_later(0.0, offer)
    cluster.run_until(stop)
    wall = time.perf_counter() - wall
    cluster.check_safety()
    latencies = sorted(
        (cluster.committed[p.index].at - p.at) * 1000 for p in proposals if cluster.is_committed(p)
    )
    in_window = sum(
        1 for p in proposals if cluster.is_committed(p) and cluster.committed[p.index].at <= stop
    )
    return {
        "offered_per_s": round(1 / interval_s, 1),
        "commits_per_s": round(in_window / LOAD_DURATION_S, 1),
        "commit_latency_median_ms": round(statistics.median(latencies), 3),
        "commit_latency_p99_ms": round(_quantile(latencies, 0.99), 3),
        "sim_commits_per_wall_s": round(in_window / wall, 1),
    }


REAL_PROFILE = "lan"
REAL_TARGET_MS = 2000.0
REAL_POLL_S = 0.01


def _real_leader(views: Views, nodes: list[LocalNode]) -> LocalNode | None:
    """The node that says it leads and that every answering node follows."""
    named = {view["leader"] for view in views.values() if view is not None}
    for node in nodes:
        view = views.get(node.name)
        if named == {node.node_id} and view is not None and view["raft"]["role"] == "leader":
            return node
    return None


async def _real_failover_trials(root: Path, trials: int) -> list[float]:
    async with (
        LocalSwarm(root, profile=REAL_PROFILE) as swarm,
        httpx.AsyncClient(timeout=2.0) as client,
    ):
        nodes = [swarm.new_node() for _ in range(VOTERS)]
        await swarm.start_ready(nodes[0])
        await swarm.start_many(nodes[1:], [nodes[0].seed])
        await swarm.make_eligible(nodes[0], nodes[1:])

        def settled(views: Views) -> bool:
            leader = _real_leader(views, nodes)
            view = None if leader is None else views.get(leader.name)
            return (
                view is not None
                and len(view["raft"]["voters"]) == VOTERS
                and len({v["commit_index"] for v in views.values() if v}) == 1
            )

        results = []
        for _ in range(trials):
            await swarm.wait_for(nodes, settled, 60.0, "five voters, all caught up")
            views = await swarm.views(nodes)
            leader = _real_leader(views, nodes)
            leader_view = None if leader is None else views.get(leader.name)
            assert leader is not None and leader_view is not None
            old_term = leader_view["term"]
            survivors = [n for n in nodes if n is not leader]
            leader.kill()
            killed_at = trio.current_time()
            # One entry per trial, offered until it commits: a node id nobody holds.
            entry = {
                "node_id": os.urandom(32).hex(),
                "model": "m",
                "layers": [0, 1],
                "recipe": "fp32",
            }
            for attempt in range(1_000_000):
                target = survivors[attempt % len(survivors)]
                try:
                    reply = await client.post(
                        target.api + ASSIGN_PATH,
                        json=entry,
                        headers={**target.admin_headers(), "content-type": "application/json"},
                    )
                except httpx.HTTPError:
                    reply = None
                if reply is not None and _committed_after(reply, old_term):
                    break
                if trio.current_time() - killed_at > 30.0:
                    raise RuntimeError("no new leader committed within 30 s")
                await trio.sleep(REAL_POLL_S)
            results.append((trio.current_time() - killed_at) * 1000)
            await leader.wait_exit(5)
            await swarm.start_ready(leader, [survivors[0].seed])
        return results


def _committed_after(reply: httpx.Response, old_term: int) -> bool:
    """Whether `reply` says the trial's entry is committed in a term after
    `old_term`. A 409 `already_assigned` is an earlier poll's copy,
    committed after the kill, so in a newer term too (the old leader's
    term had no other leader); other refusals (503 in the election) retry,
    but a 4xx other than that is a bug in this benchmark."""
    if reply.status_code == 200:
        return bool(reply.json()["term"] > old_term)
    if reply.status_code == 409 and reply.json()["error"]["code"] == "already_assigned":
        return True
    if 400 <= reply.status_code < 500:
        raise RuntimeError(f"the survivor refused the entry: {reply.status_code} {reply.text}")
    return False


def real_failover(trials: int) -> list[float]:
    """Failover times (ms) of `trials` SIGKILLed leaders among 5 real processes."""
    with tempfile.TemporaryDirectory(prefix="shardmesh-failover-") as root:
        return trio.run(_real_failover_trials, Path(root), trials)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--runs", type=int, default=200, help="crash runs (seeds 0..N-1)")
    parser.add_argument(
        "--real-trials",
        type=int,
        default=5,
        help="leader kills among 5 real processes on loopback (0 skips them)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.real_trials < 0:
        parser.error("--real-trials must be >= 0")

    wall = time.perf_counter()
    runs = [failover_run(seed) for seed in range(args.runs)]
    failover = sorted(r["failover_ms"] for r in runs)
    election = sorted(r["election_ms"] for r in runs)
    sweep = [throughput_run(interval) for interval in LOAD_INTERVALS_S]
    sustained = [r for r in sweep if r["commit_latency_p99_ms"] <= LATENCY_BOUND_MS]
    best = max(sustained, key=lambda r: r["commits_per_s"], default=sweep[0])
    sim_wall = time.perf_counter() - wall
    real = sorted(real_failover(args.real_trials)) if args.real_trials else []
    real_median = round(statistics.median(real), 1) if real else None
    wall = time.perf_counter() - wall

    median = statistics.median(failover)
    worst = failover[-1]
    result: dict[str, Any] = {
        "benchmark": "failover",
        "voters": VOTERS,
        "election_timeout_ms": [ELECTION_TICKS * TICK_S * 1000, 2 * ELECTION_TICKS * TICK_S * 1000],
        "heartbeat_ms": TICK_S * 1000,
        "network": "lan: 0.5-2 ms one-way, no loss",
        "runs": args.runs,
        "failover_median_ms": round(median, 1),
        "failover_p99_ms": round(_quantile(failover, 0.99), 1),
        "failover_max_ms": round(worst, 1),
        "failover_min_ms": round(failover[0], 1),
        "election_median_ms": round(statistics.median(election), 1),
        "election_max_ms": round(election[-1], 1),
        "runs_needing_more_than_one_term": sum(1 for r in runs if r["terms"] > 1),
        "commits_per_s": best["commits_per_s"],
        "commits_per_s_offered": best["offered_per_s"],
        "commit_latency_median_ms": best["commit_latency_median_ms"],
        "commit_latency_p99_ms": best["commit_latency_p99_ms"],
        "commit_latency_bound_ms": LATENCY_BOUND_MS,
        "load_sweep": sweep,
        "raft_thesis_median_ms": THESIS_MEDIAN_MS,
        "raft_thesis_worst_ms": THESIS_WORST_MS,
        "median_vs_thesis": round(median / THESIS_MEDIAN_MS, 3),
        "max_vs_thesis": round(worst / THESIS_WORST_MS, 3),
        "target_median_ms": TARGET_MEDIAN_MS,
        "target_max_ms": TARGET_MAX_MS,
        "meets_targets": median <= TARGET_MEDIAN_MS and worst <= TARGET_MAX_MS,
        "real_failover_ms": real_median,
        "real_failover_trials_ms": [round(ms, 1) for ms in real],
        "real_failover_profile": REAL_PROFILE,
        "real_target_ms": REAL_TARGET_MS,
        "real_meets_target": real_median is not None and real_median <= REAL_TARGET_MS,
        "note": "failover_*: simulated (virtual time, real RaftNode core), ends when the new "
        "leader commits an entry of its own term. real_failover_ms: median over real "
        "processes on loopback (lan profile), SIGKILL of the leader until a survivor's API "
        "commits in a newer term.",
        "sim_wall_s": round(sim_wall, 2),
        "wall_s": round(wall, 2),
    }
    if not args.json:
        print(
            f"failover over {args.runs} runs: median {median:.1f} ms, "
            f"p99 {result['failover_p99_ms']} ms, max {worst:.1f} ms "
            f"(thesis: {THESIS_MEDIAN_MS} / {THESIS_WORST_MS} ms); "
            f"{best['commits_per_s']} commits/s sustained at {best['offered_per_s']}/s offered; "
            f"real processes: median {real_median} ms over {real}",
            file=sys.stderr,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
