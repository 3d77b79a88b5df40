"""Gossip benchmark: the real membership core in the simulator, side by side
with memberlist's analytic model.

    python -m benchmarks.gossip [--json] [--quick] [--seed N]

Per swarm size and loss rate, how fast a new record reaches 99.9% of nodes
and what every node sends meanwhile; at 1,000 nodes, crash detection time
and false `dead` verdicts. The anchor is serf's analytic convergence model
for memberlist (fanout 3, 200 ms rounds). The last line printed is one JSON
object; what each key means: docs/benchmarks.md#gossip.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

from mesh.config import MembershipConfig
from simulations.cluster import MembershipCluster
from simulations.network import NetworkConfig

MEMBERLIST_MODEL_P999_S = {(1000, 0.0): 2.0, (10000, 0.0): 2.2, (1000, 0.1): 2.2, (10000, 0.1): 2.4}
"""serf's analytic convergence model of memberlist (fanout 3, 200 ms rounds):
seconds to reach 99.9% of nodes."""

MEMBERLIST_BYTES_PER_NODE_PER_S = 42_000
"""The model's bandwidth bound per node, our ceiling."""

SETTLE_S = 2.0
"""Virtual seconds the swarm runs before the measured event, so every node's
timers are in their steady phase (not all aligned at t=0)."""

SPREAD_WINDOW_S = 6.0
"""Virtual seconds after publishing during which spread and bytes are
measured: several times the expected p99.9, so the tail is seen."""


def spread_run(nodes: int, loss: float, seed: int) -> dict[str, Any]:
    config = MembershipConfig.lan()
    cluster = MembershipCluster(
        nodes,
        seed,
        config=config,
        network=NetworkConfig.lan(loss=loss, count_bytes=True),
        join="preconverged",
    )
    cluster.run_until(SETTLE_S)
    mark = cluster.traffic_mark()
    publication = cluster.publish(0, at=SETTLE_S)
    cluster.run_until(SETTLE_S + SPREAD_WINDOW_S)
    traffic = cluster.traffic(mark)
    times = sorted(t for t in cluster.spread_times(publication).values() if t is not None)
    needed = math.ceil(0.999 * nodes)
    p999 = times[needed - 1] if len(times) >= needed else math.inf
    anchor = MEMBERLIST_MODEL_P999_S.get((nodes, loss))
    return {
        "nodes": nodes,
        "loss": loss,
        "spread_p999_s": round(p999, 4),
        "rounds_p999": round(p999 / config.gossip_interval, 2),
        "reached_fraction": round(len(times) / nodes, 5),
        "bytes_per_node_per_s": round(traffic["bytes_per_node_second"], 1),
        "max_bytes_per_node_per_s": round(traffic["max_bytes_per_node_second"], 1),
        "messages_per_node_per_s": round(traffic["messages_per_node_second"], 2),
        "memberlist_model_p999_s": anchor,
        "spread_vs_anchor": None if anchor is None else round(p999 / anchor, 3),
        "bytes_vs_anchor": round(
            traffic["bytes_per_node_second"] / MEMBERLIST_BYTES_PER_NODE_PER_S, 4
        ),
    }


def detection_run(nodes: int, seed: int) -> dict[str, Any]:
    config = MembershipConfig.lan()
    cluster = MembershipCluster(nodes, seed, config=config, join="preconverged")
    crash_at = SETTLE_S + 3.0
    victim = nodes // 2
    cluster.crash(victim, at=crash_at)
    deadline = crash_at + config.suspicion_max_timeout(nodes) + 30.0
    step = 1.0
    while cluster.now < deadline:
        cluster.run_for(step)
        if cluster.now > crash_at and all(
            t is not None for t in cluster.detection_times(victim).values()
        ):
            break
    detected = [t for t in cluster.detection_times(victim).values() if t is not None]
    survivors = nodes - 1
    return {
        "nodes": nodes,
        "detect_median_s": round(statistics.median(detected), 3) if detected else None,
        "detect_max_s": round(max(detected), 3) if detected else None,
        "detected_fraction": round(len(detected) / survivors, 5),
        "suspicion_min_timeout_s": config.suspicion_min_timeout(nodes),
    }


def false_positive_run(nodes: int, loss: float, seconds: float, seed: int) -> dict[str, Any]:
    cluster = MembershipCluster(
        nodes,
        seed,
        config=MembershipConfig.lan(),
        network=NetworkConfig.lan(loss=loss),
        join="preconverged",
    )
    cluster.run_until(seconds)
    wrong = cluster.false_positives()
    node_hours = nodes * seconds / 3600.0
    return {
        "nodes": nodes,
        "loss": loss,
        "simulated_s": seconds,
        "false_dead_verdicts": len(wrong),
        "false_positives_per_node_hour": len(wrong) / node_hours,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--quick", action="store_true", help="1,000 nodes only, shorter runs")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    sizes = [1000] if args.quick else [1000, 10000]
    runs = []
    started = time.perf_counter()
    for nodes in sizes:
        for loss in (0.0, 0.1):
            say(f"spread: {nodes} nodes, loss {loss:.0%} ...")
            t0 = time.perf_counter()
            run = spread_run(nodes, loss, args.seed)
            run["wall_s"] = round(time.perf_counter() - t0, 2)
            runs.append(run)
            say(f"  {json.dumps(run)}")
    say("detection: 1000 nodes, one crash ...")
    detection = detection_run(1000, args.seed)
    say(f"  {json.dumps(detection)}")
    fp_seconds = 60.0 if args.quick else 300.0
    say(f"false positives: 1000 nodes, loss 10%, {fp_seconds:.0f} s ...")
    false_positives = false_positive_run(1000, 0.1, fp_seconds, args.seed)
    say(f"  {json.dumps(false_positives)}")

    headline = next(r for r in runs if r["nodes"] == 1000 and r["loss"] == 0.0)
    result = {
        "benchmark": "gossip",
        "nodes": headline["nodes"],
        "loss": headline["loss"],
        "spread_p999_s": headline["spread_p999_s"],
        "rounds_p999": headline["rounds_p999"],
        "bytes_per_node_per_s": headline["bytes_per_node_per_s"],
        "memberlist_model_p999_s": headline["memberlist_model_p999_s"],
        "detect_median_s": detection["detect_median_s"],
        "false_positives_per_node_hour": false_positives["false_positives_per_node_hour"],
        "targets_met": {
            "spread_le_anchor": all(
                r["spread_p999_s"] <= r["memberlist_model_p999_s"] for r in runs
            ),
            "bytes_le_42000": all(
                r["bytes_per_node_per_s"] <= MEMBERLIST_BYTES_PER_NODE_PER_S for r in runs
            ),
            "detect_median_le_15s": (detection["detect_median_s"] or math.inf) <= 15.0,
            "zero_false_positives_at_10pct_loss": false_positives["false_dead_verdicts"] == 0,
        },
        "runs": runs,
        "detection": detection,
        "false_positives": false_positives,
        "seed": args.seed,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
