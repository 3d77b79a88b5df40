"""Direct paths past NAT: which pairs of nodes end up talking directly, per NAT kind.

    python -m benchmarks.direct_paths [--json] [--wait S]

One WAN lab (20 ms RTT between sites, no loss): a public node `a` (the
seed, and the relay), two homes behind port-preserving NAT routers (`p1`,
`p2`) and two behind symmetric ones (`s1`, `s2`), each running a bare
`shardmesh node` (no model: the control plane is what every pair of
members talks on). The homes learn they are behind NAT, reserve at `a`,
and every node punches the relayed members it talks to
(`runtime.node.direct_paths`). Once every pair has settled (a path, or a
failed punch) each node's status says which of its paths are direct. A
direction (x reaching y) counts as direct when x holds a direct path to y
or y to x (a connection carries both ways); the fraction of directions
that are, per kind of pair, is the result. Needs root. The last line is
one JSON object; its keys: docs/benchmarks.md#direct-paths.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm
from runtime.lab.netns import Lab, unavailable
from runtime.lab.topology import load_topology

SITES: Final = {
    "a": "none",
    "p1": "port-preserving",
    "p2": "port-preserving",
    "s1": "symmetric",
    "s2": "symmetric",
}
"""Site -> its NAT (`none`: public)."""
KIND: Final = {"none": "public", "port-preserving": "pp", "symmetric": "sym"}
EXPECTED: Final = {"public_pp": 1.0, "public_sym": 1.0, "pp_pp": 1.0, "pp_sym": 0.0, "sym_sym": 0.0}
"""What the NATs allow: a public node is dialed back through any NAT; two
port-keeping NATs meet by simultaneous open; a symmetric one never does."""
START_TIMEOUT_S: Final = 60.0
SETTLE_S: Final = 60.0
"""Relayed about 7 s after start, then a punch per pair (up to 5 s each,
four at once per node)."""
POLL_S: Final = 1.0


def spec() -> dict[str, Any]:
    return {
        "seed": 29,
        "link": {"delay_ms": 5, "jitter_ms": 0, "loss": 0.0},
        "sites": [{"name": name, "nat": nat} for name, nat in SITES.items()],
    }


def pair_kind(x: str, y: str) -> str:
    """`public_pp`, `pp_sym`, ...: the two sites' NAT kinds, in a fixed order."""
    order = list(KIND.values())
    kinds = sorted((KIND[SITES[x]], KIND[SITES[y]]), key=order.index)
    return "_".join(kinds)


def fractions(direct: Mapping[str, set[str]]) -> dict[str, float]:
    """Per kind of pair, the fraction of directions that are direct, from
    each site's set of sites it holds a direct path to."""
    counted: dict[str, list[bool]] = {}
    for x, y in itertools.permutations(SITES, 2):
        if SITES[x] == SITES[y] == "none":
            continue  # two public nodes: direct without punching
        is_direct = y in direct.get(x, set()) or x in direct.get(y, set())
        counted.setdefault(pair_kind(x, y), []).append(is_direct)
    return {kind: round(sum(seen) / len(seen), 3) for kind, seen in sorted(counted.items())}


def settled(document: Mapping[str, Any]) -> bool:
    """A node whose punches are all over: none trying now."""
    direct = (document.get("relays") or {}).get("direct") or {}
    counters = direct.get("counters", {})
    done = sum(v for k, v in counters.items() if k.startswith(("direct_", "failed_")))
    return counters.get("attempts", 0) > 0 and done >= counters.get("attempts", 0)


async def measure(lab: Lab, root: Path) -> dict[str, Any]:
    async with LocalSwarm(root, profile="local", lab=lab) as swarm:
        nodes = [swarm.new_node(site, site=site) for site in SITES]
        await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
        await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=START_TIMEOUT_S)
        began = trio.current_time()
        views: dict[str, Any] = {}
        while trio.current_time() - began < SETTLE_S:
            await trio.sleep(POLL_S)
            views = await swarm.views(nodes)
            homes = [views.get(node.name) or {} for node in nodes[1:]]
            if all(settled(view) for view in homes):
                break
        return {
            "settled_s": round(trio.current_time() - began, 1),
            "direct": direct_sites(nodes, views),
            "counters": {
                node.name: ((views.get(node.name) or {}).get("relays") or {})
                .get("direct", {})
                .get("counters", {})
                for node in nodes
            },
        }


def direct_sites(nodes: Sequence[LocalNode], views: Mapping[str, Any]) -> dict[str, set[str]]:
    """Site -> the sites it holds a direct control-plane path to."""
    site_of = {node.node_id[:16]: node.name for node in nodes}
    found: dict[str, set[str]] = {}
    for node in nodes:
        relays = (views.get(node.name) or {}).get("relays") or {}
        paths = (relays.get("direct") or {}).get("paths", [])
        found[node.name] = {
            site_of[p["node"]] for p in paths if p["plane"] == "control" and p["node"] in site_of
        }
    return found


def result(measured: dict[str, Any], began: float) -> dict[str, Any]:
    got = fractions(measured["direct"])
    return {
        "benchmark": "direct_paths",
        **{f"direct_fraction_{kind}": value for kind, value in got.items()},
        "as_the_nats_allow": all(got.get(k) == v for k, v in EXPECTED.items()),
        "expected": EXPECTED,
        "settled_s": measured["settled_s"],
        "direct": {site: sorted(to) for site, to in measured["direct"].items()},
        "counters": measured["counters"],
        "wall_s": round(time.perf_counter() - began, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        parser.error(f"no WAN lab here: {reason}")
    began = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="shardmesh-direct-") as tmp,
        Lab(load_topology(spec())) as lab,
    ):
        measured = trio.run(measure, lab, Path(tmp))
    out = result(measured, began)
    if not args.json:
        for key, value in out.items():
            if key.startswith("direct_fraction_"):
                print(f"{key.removeprefix('direct_fraction_')}: {value}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
