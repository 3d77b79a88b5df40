"""Placement benchmark: the leader's placement policy, and demand placement end
to end through real node processes.

    python -m benchmarks.placement [--json] [--runs N] [--seed S] [--trials N]

`consensus.placement.decide` timed on a synthetic busy swarm of 10,000
nodes and 100 models; then, on real processes on loopback, a first chat
request for a model nobody serves, timed to the committed assignment and to
its first streamed token. The last line printed is one JSON object; how the
snapshot is shaped and what each key means: docs/benchmarks.md#placement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from consensus.ledger import Demand, LedgerAssignment
from consensus.placement import (
    AdmissionFailures,
    CapabilityState,
    ModelFacts,
    NodeView,
    PlacementInput,
    PlacementSettings,
    decide,
)
from mesh.member_table import MemberStateName

NODES = 10_000
MODELS = 100
TARGET_DECIDE_MS = 100.0
TARGET_DEMAND_TO_COMMIT_MS = 1000.0
GB = 1 << 30
NOW = 1_000_000.0
"""Virtual time of the snapshot; far from 0 so every history is in the past."""


def _node_id(index: int) -> bytes:
    return index.to_bytes(4, "big") * 8


def synthetic_snapshot(nodes: int = NODES, models: int = MODELS, seed: int = 1) -> PlacementInput:
    """A deterministic busy-swarm snapshot (shape in the module doc)."""
    rng = random.Random(seed)
    names = [f"model-{i:03d}" for i in range(models)]
    facts = {
        name: ModelFacts(
            num_layers=rng.randint(24, 96),
            layer_bytes=int(rng.uniform(0.1, 1.5) * GB),
            overhead_bytes=int(rng.uniform(1, 3) * GB),
        )
        for name in names
    }
    weights = [1.0 / (rank + 1) for rank in range(models)]  # popular models are in more stores
    views: dict[bytes, NodeView] = {}
    assignments: dict[bytes, LedgerAssignment] = {}
    epochs: dict[bytes, int] = {}
    failures: dict[tuple[bytes, str], AdmissionFailures] = {}
    for index in range(nodes):
        node = _node_id(index)
        store = frozenset(rng.choices(names, weights, k=rng.randint(1, 6)))
        roll = rng.random()
        state: MemberStateName = "dead" if roll < 0.03 else "suspect" if roll < 0.05 else "alive"
        kind = rng.random()
        capability: CapabilityState = "none"
        if kind < 0.45:
            model = rng.choice(sorted(store))
            length = facts[model].num_layers
            start = rng.randrange(length)
            end = min(length, start + rng.randint(4, 32))
            pinned = kind < 0.30
            tier = rng.choice(("operator", "bootstrap")) if pinned else "managed"
            epoch = rng.randint(1, 5)
            failed_at = NOW - 5.0 if not pinned and rng.random() < 0.05 else None
            assignments[node] = LedgerAssignment(
                node, model, (start, end), "bf16", tier, not pinned, epoch,
                NOW - rng.uniform(0, 7200), failed_at,
            )  # fmt: skip
            epochs[node] = epoch
            capability = "admitted" if pinned or rng.random() < 0.7 else "none"
        if rng.random() < 0.03:
            failures[(node, rng.choice(names))] = AdmissionFailures(rng.randint(1, 4), NOW - 100)
        views[node] = NodeView(
            state=state,
            state_since=NOW - rng.uniform(0, 300),
            memory_bytes=rng.choice((8, 16, 24, 48, 80, 128, 192)) * GB,
            models=store,
            spare=node not in assignments or assignments[node].managed,
            capability=capability,
        )
    demand = {}
    for rank, name in enumerate(names[:70]):
        last = NOW - (rng.uniform(0, 120) if rank < 60 else rng.uniform(2000, 5000))
        count = max(1, int(4000 / (rank + 1)))
        demand[name] = Demand(count, last - rng.uniform(0, 3600), last)
    return PlacementInput(
        now=NOW,
        has_quorum=True,
        assignments=assignments,
        epochs=epochs,
        demand=demand,
        nodes=views,
        models=facts,
        failures=failures,
    )


def decide_ms(runs: int, seed: int) -> tuple[float, list[float], int]:
    """Median and all wall times (ms) of `decide` on the synthetic snapshot, and
    how many decisions it returned."""
    snapshot = synthetic_snapshot(seed=seed)
    policy = PlacementSettings()
    times: list[float] = []
    count = 0
    for _ in range(runs):
        started = time.perf_counter()
        count = len(decide(snapshot, policy))
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times), times, count


RETRY_S = 0.05


async def _demand_trial(root: Path) -> tuple[float, float]:
    from runtime.cli.localswarm import LocalSwarm
    from runtime.model.tiny import make_tiny_model

    x = make_tiny_model(root / "x", layers=8, name="x")
    make_tiny_model(root / "store" / "y", layers=8, seed=2, name="y")
    body = {"model": "y", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with LocalSwarm(root / "swarm", profile="local") as swarm:
        a = swarm.new_node("a", args=["--model", str(x), "--layers", "0:8"])
        b = swarm.new_node("b", args=["--models", str(root / "store")])
        await swarm.start_ready(a, timeout=60)
        await swarm.start_ready(b, [a.seed], timeout=60)

        def ready(views: dict[str, Any]) -> bool:
            view = views["a"] or {}
            record = next((m["record"] for m in view.get("members", []) if not m["self"]), None)
            known = "y" in view.get("placement", {}).get("models", {})
            return bool(record and record.get("backend")) and known and bool(view.get("ledger"))

        await swarm.wait_for([a], ready, 60.0, "B's capacity and Y's size known")
        async with httpx.AsyncClient(timeout=30) as client:
            sent = time.time()
            first = await client.post(a.api + "/v1/chat/completions", json=body)
            assert first.status_code == 503, first.text
            while True:
                async with client.stream(
                    "POST", a.api + "/v1/chat/completions", json={**body, "stream": True}
                ) as response:
                    if response.status_code == 200:
                        async for line in response.aiter_lines():
                            if '"content": "' in line and '"content": ""' not in line:
                                break
                        first_token = time.time()
                        break
                await trio.sleep(RETRY_S)
        view = await swarm.status(a)
        assert view is not None
        decision = next(
            d
            for d in view["placement"]["decisions"]
            if d["model"] == "y" and d["command"] == "Assign"
        )
    return (decision["at"] - sent) * 1000.0, first_token - sent


def demand_trials(trials: int) -> list[tuple[float, float]]:
    results = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory(prefix="shardmesh-placement-") as tmp:
            results.append(trio.run(_demand_trial, Path(tmp)))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--runs", type=int, default=9, help="decide() calls to take the median of")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--trials", type=int, default=3, help="real-process demand trials (0 skips them)"
    )
    args = parser.parse_args(argv)
    median, times, decisions = decide_ms(args.runs, args.seed)
    trials = demand_trials(args.trials) if args.trials > 0 else []
    commit_ms = [round(c, 1) for c, _ in trials]
    first_token_s = [round(f, 3) for _, f in trials]
    if not args.json:
        print(
            f"decide(): {NODES} nodes, {MODELS} models: median {median:.1f} ms over "
            f"{args.runs} runs, {decisions} decisions",
            file=sys.stderr,
        )
    result: dict[str, Any] = {
        "decide_ms_10k_nodes_100_models": round(median, 2),
        "decide_ms_target": TARGET_DECIDE_MS,
        "decide_ms_runs": [round(t, 2) for t in times],
        "decide_decisions": decisions,
        "demand_to_commit_ms": statistics.median(commit_ms) if trials else None,
        "demand_to_commit_ms_trials": commit_ms,
        "demand_to_commit_ms_target": TARGET_DEMAND_TO_COMMIT_MS,
        "demand_to_first_token_s": statistics.median(first_token_s) if trials else None,
        "demand_to_first_token_s_trials": first_token_s,
        "meets_targets": median <= TARGET_DECIDE_MS
        and (not trials or statistics.median(commit_ms) <= TARGET_DEMAND_TO_COMMIT_MS),
        "note": "demand figures: real processes on loopback (local profile), tiny model",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
