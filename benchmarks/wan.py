"""WAN benchmark: a three-hop chain of real node processes in three lab
sites (`runtime.lab`), its per-token time beside the floor of its loop.

    python -m benchmarks.wan [--json] [--quick] [--tokens N] [--requests N]

For each RTT (10, 40, 100 ms between every pair) with and without 1% loss
on every link, a fresh lab of three public sites is built, measured
(`runtime.lab.check`), and a `wan`-profile swarm serves the tiny model in
three hops (site a holds layers 0:3 and takes the chat, b 3:6, c 6:8).
Per-token time is the entry's decode time over tokens (`decode_ms_per_token`,
not gaps between chunks); the floor is the sum of the one-way delays around
the loop (entry -> hop -> ... -> last hop -> entry) plus the hops' measured
compute. Three last cases put b and c at home behind NAT routers: with a
symmetric NAT, reached through the relay the entry runs, which lets no
direct path through from b to c (`relay_per_token_vs_direct`, beside the
direct chain at 40 ms); the same through a well-connected relay in a site
of its own (`near_relay_per_token_vs_direct`); and with two port-keeping
NATs, which b and c punch through (`punched_per_token_vs_direct`). Needs
root (network namespaces). `--quick` runs one case with few tokens, for a
test; `--relay` only the chains compared. The last line printed is one
JSON object; what each key means: docs/benchmarks.md#wan.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm
from runtime.lab.check import run_check
from runtime.lab.netns import Lab, unavailable
from runtime.lab.topology import Topology, load_topology
from runtime.model.tiny import make_tiny_model

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the swarm of volunteers."}]
SITES = ("a", "b", "c")
SPANS = ("0:3", "3:6", "6:8")
RTTS_MS = (10.0, 40.0, 100.0)
LOSSES = (0.0, 0.01)
HEADLINE = (40.0, 0.01)
"""The case `wan_per_token_vs_floor` reports: the issue's volunteers."""
TARGET_PER_TOKEN_VS_FLOOR = 1.15
START_TIMEOUT_S = 90.0
"""Three interpreters importing torch at once on a busy machine (spawned:
a node in a lab site is never forked)."""
COVERAGE_TIMEOUT_S = 90.0
CHAT_TIMEOUT_S = 120.0
"""A request of 64 tokens at 100 ms RTT with loss takes about 10 s."""
CHECK_PROBES = (100, 20)
"""Round trips per pair in `runtime.lab.check`: full run, quick."""
RELAY_WHY = "--quick measures no relayed chain (run without it, or with --relay)"
RELAY_CASE = (40.0, 0.0)
"""The relayed chain is measured at 40 ms RTT without loss, beside the
direct chain of the same case."""
TARGET_RELAY_PER_TOKEN_VS_DIRECT = 1.3
HOME_NATS: dict[str, dict[str, str]] = {
    "": {},
    "relayed": {"b": "port-preserving", "c": "symmetric"},
    "punched": {"b": "port-preserving", "c": "port-preserving"},
    "near": {"b": "port-preserving", "c": "symmetric"},
}
"""Which hops sit at home behind which NAT routers. `relayed`: b and c,
reached through the relay the entry a runs (their join seed); a reaches
both directly by reversal, but b's activations to c go b -> relay -> c, as
c's symmetric NAT lets no punch through. `punched`: both NATs keep the
port, so b and c punch a direct path too (docs/design/relays.md#direct-paths).
`near`: as `relayed`, but b and c join through a bare relay node in site
`r`, `NEAR_RELAY_MS` from the core (a relay in a data centre), so b -> c
crosses it instead of the entry's site."""
NEAR_RELAY_SITE = "r"
NEAR_RELAY_MS = 1.0
"""Site r's one-way access delay: a well-connected relay, one that adds
2 ms to the relayed leg where a volunteer's site like a's adds 20."""


def spec(rtt_ms: float, loss: float, homes: str = "") -> dict[str, Any]:
    """Three sites, RTT/4 one way on every access link, `loss` on each;
    b and c behind NAT routers as `HOME_NATS[homes]` says."""
    link = {"delay_ms": rtt_ms / 4, "jitter_ms": 0, "loss": loss}
    nats = HOME_NATS[homes]
    sites: list[dict[str, Any]] = [
        {"name": name, **({"nat": nats[name]} if name in nats else {})} for name in SITES
    ]
    if homes == "near":
        sites.append({"name": NEAR_RELAY_SITE, "delay_ms": NEAR_RELAY_MS})
    return {"seed": 29, "link": link, "sites": sites}


def loop_ms(topology: Topology, sites: Sequence[str]) -> float:
    """The one-way delays around `sites`, entry first, back to the entry;
    consecutive steps within one site cost nothing (its own loopback)."""
    loop = [*sites, sites[0]]
    return sum(topology.one_way_ms(a, b) for a, b in itertools.pairwise(loop) if a != b)


def floor_ms(topology: Topology, sites: Sequence[str], timing: dict[str, Any]) -> dict[str, float]:
    """A request's floor per token: the loop's delays plus the hops' compute."""
    compute = sum(hop["decode_ms_per_step"] for hop in timing["hops"])
    loop = loop_ms(topology, sites)
    return {"loop_ms": loop, "compute_ms": round(compute, 3), "floor_ms": round(loop + compute, 3)}


async def start_chain(swarm: LocalSwarm, model_dir: Path, homes: str = "") -> list[LocalNode]:
    """One hop per site, a founding; chat routes once the model is covered.
    For `near` a bare relay node in site r first, the others' first seed."""
    nodes = [
        swarm.new_node(site, args=["--model", str(model_dir), "--layers", span], site=site)
        for site, span in zip(SITES, SPANS, strict=True)
    ]
    await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
    seeds = [nodes[0].seed]
    if homes == "near":
        relay = swarm.new_node(NEAR_RELAY_SITE, site=NEAR_RELAY_SITE)
        await swarm.start_many([relay], seeds, timeout=START_TIMEOUT_S)
        seeds.insert(0, relay.seed)
    await swarm.start_many(nodes[1:], seeds, timeout=START_TIMEOUT_S)

    def covered(views: dict[str, Any]) -> bool:
        coverage = (views.get(nodes[0].name) or {}).get("coverage", {}).get(MODEL)
        return coverage is not None and not coverage["gaps"] and len(coverage["nodes"]) == 3

    await swarm.wait_for(nodes[:1], covered, COVERAGE_TIMEOUT_S, "the model covered")
    return nodes


async def chat(client: httpx.AsyncClient, entry: LocalNode, tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0}
    response = await client.post(entry.api + "/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"chat failed: {response.status_code} {response.text[:500]}")
    return dict(response.json())


async def measure_swarm(
    lab: Lab, root: Path, model_dir: Path, tokens: int, requests: int, homes: str = ""
) -> list[dict[str, Any]]:
    """Each measured request's per-token time beside its floor (one warm-up first)."""
    async with LocalSwarm(root, profile="wan", lab=lab) as swarm:
        nodes = await start_chain(swarm, model_dir, homes)
        site_of = {node.node_id: node.site or "" for node in nodes}
        rows = []
        async with httpx.AsyncClient(timeout=CHAT_TIMEOUT_S) as client:
            for index in range(requests + 1):
                body = await chat(client, nodes[0], tokens)
                if index == 0:
                    continue  # warm-up: first-use costs in every hop
                timing = body["shardmesh"]["timing"]
                sites = ["a", *(site_of[hop] for hop in body["shardmesh"]["route"])]
                rows.append(
                    {
                        "per_token_ms": timing["decode_ms_per_token"],
                        "ttft_ms": timing["ttft_ms"],
                        "tokens": body["usage"]["completion_tokens"],
                        "route_sites": sites[1:],
                        **floor_ms(lab.topology, sites, timing),
                    }
                )
        return rows


def summarize(
    rtt_ms: float, loss: float, check: dict[str, Any], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """One case: medians over its requests, and the ratio to the floor."""
    per_token = statistics.median(row["per_token_ms"] for row in rows)
    floor = statistics.median(row["floor_ms"] for row in rows)
    return {
        "rtt_ms": rtt_ms,
        "loss": loss,
        "per_token_ms": round(per_token, 2),
        "floor_ms": round(floor, 2),
        "loop_ms": rows[0]["loop_ms"],
        "compute_ms": round(statistics.median(row["compute_ms"] for row in rows), 3),
        "per_token_vs_floor": round(per_token / floor, 3),
        "ttft_ms": round(statistics.median(row["ttft_ms"] for row in rows), 1),
        "tokens": [row["tokens"] for row in rows],
        "route_sites": rows[0]["route_sites"],
        "rtt_error_ms": check["rtt_error_ms"],
        "lab_ok": check["ok"],
    }


def run_case(
    root: Path,
    model_dir: Path,
    case: tuple[float, float],
    tokens: int,
    requests: int,
    probes: int,
    homes: str = "",
) -> dict[str, Any]:
    """A fresh lab for one (RTT, loss): measured, then a swarm in it."""
    rtt_ms, loss = case
    with Lab(load_topology(spec(rtt_ms, loss, homes))) as lab:
        check = run_check(lab, count=probes) if not homes else {"rtt_error_ms": None, "ok": True}
        folder = root / f"rtt{rtt_ms:g}-loss{loss:g}{'-' + homes if homes else ''}"
        rows = trio.run(measure_swarm, lab, folder, model_dir, tokens, requests, homes)
    return {**summarize(rtt_ms, loss, check, rows), "relayed": bool(homes), "homes": homes}


def vs_direct(
    cases: list[dict[str, Any]], homes: str, beside: dict[str, Any] | None
) -> float | None:
    """Per token with b and c at home (`homes`) over the direct chain's."""
    case = next((c for c in cases if c.get("homes") == homes), None)
    if case is None or beside is None:
        return None
    return round(case["per_token_ms"] / beside["per_token_ms"], 3)


def result(cases: list[dict[str, Any]], began: float) -> dict[str, Any]:
    direct = [c for c in cases if not c["relayed"]]
    headline = next((c for c in direct if (c["rtt_ms"], c["loss"]) == HEADLINE), None)
    errors = [abs(c["rtt_error_ms"]) for c in cases if c["rtt_error_ms"] is not None]
    ratio = None if headline is None else headline["per_token_vs_floor"]
    beside = next((c for c in direct if (c["rtt_ms"], c["loss"]) == RELAY_CASE), None)
    relay_ratio, punched_ratio, near_ratio = (
        vs_direct(cases, homes, beside) for homes in HOME_NATS if homes
    )
    return {
        "benchmark": "wan",
        "wan_per_token_vs_floor": ratio,
        "target_wan_per_token_vs_floor": TARGET_PER_TOKEN_VS_FLOOR,
        "meets_wan_target": None if ratio is None else ratio <= TARGET_PER_TOKEN_VS_FLOOR,
        "rtt_error_ms": max(errors) if errors else None,
        "relay_per_token_vs_direct": relay_ratio,
        "target_relay_per_token_vs_direct": TARGET_RELAY_PER_TOKEN_VS_DIRECT,
        **({"relay_per_token_vs_direct_why": RELAY_WHY} if relay_ratio is None else {}),
        "punched_per_token_vs_direct": punched_ratio,
        "near_relay_per_token_vs_direct": near_ratio,
        "cases": cases,
        "wall_s": round(time.perf_counter() - began, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--quick", action="store_true", help="one case (40 ms, 1%% loss), briefly")
    parser.add_argument(
        "--relay",
        action="store_true",
        help="only the chains at home and the direct one beside them (40 ms, no loss)",
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--requests", type=int, default=3, help="measured requests (default 3)")
    args = parser.parse_args(argv)
    if args.tokens < 4 or args.requests < 1:
        parser.error("--tokens must be >= 4 and --requests >= 1")
    reason = unavailable()
    if reason is not None:
        parser.error(f"no WAN lab here: {reason}")
    grid = [HEADLINE] if args.quick else [(rtt, loss) for rtt in RTTS_MS for loss in LOSSES]
    grid = [RELAY_CASE] if args.relay else grid
    tokens, requests = (8, 1) if args.quick else (args.tokens, args.requests)
    probes = CHECK_PROBES[1] if args.quick else CHECK_PROBES[0]
    began = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory(prefix="shardmesh-wan-") as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / MODEL, layers=8, name=MODEL)
        homes = [] if args.quick else [(RELAY_CASE, h) for h in HOME_NATS if h]
        runs = [(case, "") for case in grid] + homes
        for case, home in runs:
            cases.append(run_case(root, model_dir, case, tokens, requests, probes, home))
            if not args.json:
                done = cases[-1]
                print(
                    f"{case[0]:g} ms RTT, loss {case[1]:g}{', ' + home if home else ''}: "
                    f"{done['per_token_ms']} ms/token, floor {done['floor_ms']} ms "
                    f"({done['per_token_vs_floor']}x)",
                    file=sys.stderr,
                )
    print(json.dumps(result(cases, began)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
