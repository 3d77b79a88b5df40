"""Simulator cost: CPU seconds and memory of the runs a researcher makes most.

    python -m benchmarks.simulator [--json] [--quick]

Each case is one `run_scenario` of the real membership core, alone in a
fresh child process, so its CPU time and peak RSS are its own:

- `steady_1k_600s_cpu_s`: 1,000 nodes for 600 simulated s with churn
  (pauses, a leave, crashes and restarts); target <= 30 CPU-s.
- `partition_1k_cpu_s`, `partition_1k_rss_mb`: 1,000 nodes, 150 s, a 3-way
  partition for 60 s; targets <= 30 CPU-s and <= 300 MB.
- `partition_10k_cpu_s`, `partition_10k_rss_mb`: 10,000 nodes, 60 s, a
  3-way partition from 10 s to 40 s; targets <= 120 CPU-s and <= 1,000 MB.
- `growth_exponent`: the slope of log(CPU-s) against log(nodes) over the
  60 s partition case at 1k, 3k and 10k nodes (1 is linear; the target,
  "about N log N", is at most 1.2).

`--quick` divides every node count by fifty (a smoke test of the benchmark
itself, not a measurement). The last line printed is one JSON object with
the figures above at its top level, `targets`, `meets_targets`, and every
case under `cases`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from typing import Any, Final

TARGETS: Final = {
    "steady_1k_600s_cpu_s": 30.0,
    "partition_1k_cpu_s": 30.0,
    "partition_1k_rss_mb": 300.0,
    "partition_10k_cpu_s": 120.0,
    "partition_10k_rss_mb": 1000.0,
    "growth_exponent": 1.2,
}
"""Issue 17's figures: each measured figure must be at most its target."""

CHILD: Final = """
import json, resource, sys, time
from simulations.scenario import run_scenario
scenario = json.loads(sys.argv[1])
wall = time.perf_counter()
result = run_scenario(scenario, seed=1)
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "wall_s": time.perf_counter() - wall,
    "cpu_s": usage.ru_utime + usage.ru_stime,
    "rss_mb": usage.ru_maxrss / 1024,
    "view_agreement": result["view_agreement"],
    "loop_events": result["loop_events"],
}))
"""
"""A case's child: CPU and RSS include importing the simulator (~0.3 s,
~60 MB), the same for every case."""


def steady(nodes: int) -> dict[str, Any]:
    churn = [
        {"kind": "pause", "random": 5, "at": 60.0, "duration": 4.0},
        {"kind": "leave", "node": 1, "at": 120.0},
        {"kind": "crash", "nodes": [2, 3], "at": 200.0},
        {"kind": "restart", "node": 2, "at": 300.0},
        {"kind": "crash", "node": 4, "at": 400.0},
    ]
    return {"name": "steady", "duration": 600.0, "nodes": {"count": nodes}, "faults": churn}


def partition(nodes: int, duration: float, at: float, heal: float) -> dict[str, Any]:
    third = nodes // 3
    groups = [[{"range": [0, third]}], [{"range": [third, 2 * third]}]]
    cut = {"kind": "partition", "at": at, "heal": heal, "groups": groups}
    return {"name": "partition", "duration": duration, "nodes": {"count": nodes}, "faults": [cut]}


def measure(scenario: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(scenario)],
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    nodes = scenario["nodes"]["count"]
    print(
        f"{scenario['name']:>9} {nodes:>6} nodes {scenario['duration']:>5.0f} s: "
        f"{figures['cpu_s']:7.1f} CPU-s {figures['rss_mb']:7.0f} MB",
        file=sys.stderr,
    )
    return {"nodes": nodes, "duration_s": scenario["duration"], **figures}


def growth_exponent(runs: list[dict[str, Any]]) -> float:
    """Least-squares slope of log(cpu) on log(nodes)."""
    xs = [math.log(run["nodes"]) for run in runs]
    ys = [math.log(run["cpu_s"]) for run in runs]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    return num / sum((x - mean_x) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--quick", action="store_true", help="node counts / 50 (a smoke test)")
    args = parser.parse_args()
    scale = 50 if args.quick else 1
    k1, k3, k10 = 1000 // scale, 3000 // scale, 10_000 // scale
    cases = {
        "steady_1k_600s": measure(steady(k1)),
        "partition_1k": measure(partition(k1, 150.0, 30.0, 90.0)),
        "partition_10k": measure(partition(k10, 60.0, 10.0, 40.0)),
    }
    sixty = [measure(partition(n, 60.0, 10.0, 40.0)) for n in (k1, k3)]
    sixty.append(cases["partition_10k"])
    figures = {
        "steady_1k_600s_cpu_s": round(cases["steady_1k_600s"]["cpu_s"], 2),
        "partition_1k_cpu_s": round(cases["partition_1k"]["cpu_s"], 2),
        "partition_1k_rss_mb": round(cases["partition_1k"]["rss_mb"], 1),
        "partition_10k_cpu_s": round(cases["partition_10k"]["cpu_s"], 2),
        "partition_10k_rss_mb": round(cases["partition_10k"]["rss_mb"], 1),
        "growth_exponent": round(growth_exponent(sixty), 3),
    }
    report = {
        **figures,
        "quick": args.quick,
        "targets": TARGETS,
        "meets_targets": all(figures[key] <= limit for key, limit in TARGETS.items()),
        "cases": {**cases, "growth_60s": sixty},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
