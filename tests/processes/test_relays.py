"""Relays with real `shardmesh node` processes in the WAN lab (issue 29, item 3).

Two public sites, `a` and `b`, run bare nodes (the founder in `a`); two home
sites, `c` behind a port-preserving NAT router and `d` behind a symmetric
one, serve the model's two halves. Nothing can dial `c` or `d`: each learns
it is behind NAT, reserves at the public nodes' relays, and advertises the
relayed ports, so the swarm's own ping reaches it and it becomes a member
(docs/design/membership.md#introductions). A greedy chat entered at `a`
streams, over the chain c -> d (both reached only through relays), the text
transformers' greedy `generate` gives in this process. Root only: elsewhere
it skips, saying why no lab can be built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.cli.localswarm import LocalNode, LocalSwarm, SwarmError, Views, all_see
from runtime.lab.netns import Lab
from runtime.model.tiny import make_tiny_model
from tests.processes.test_inference import MODEL, model_ready, reference_text
from tests.processes.test_wan import print_logs, streamed_text
from tests.runtime.lab.fixtures import MakeLab, make_lab  # noqa: F401 - the fixture
from tests.swarm_helpers import wait_for

SPEC = {
    "seed": 29,
    "link": {"delay_ms": 2, "jitter_ms": 0, "loss": 0.0},
    "sites": [
        {"name": "a"},
        {"name": "b"},
        {"name": "c", "nat": "port-preserving"},
        {"name": "d", "nat": "symmetric"},
    ],
}
SPANS = {"c": "0:4", "d": "4:8"}
MAX_TOKENS = 24
START_TIMEOUT_S = 40.0
"""Four interpreters starting at once on a loaded 2-core machine, two of
them importing torch."""
RELAYED_TIMEOUT_S = 30.0
"""The reachability verdict (a first round after a second, a silent
prober's five seconds), a reservation, and the join through the relay."""
COVERAGE_TIMEOUT_S = 40.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / MODEL, layers=8, name=MODEL)


async def start_sites(swarm: LocalSwarm, model_dir: Path) -> list[LocalNode]:
    nodes = []
    for site in ("a", "b", "c", "d"):
        args = ["--model", str(model_dir), "--layers", SPANS[site]] if site in SPANS else []
        if site == "a":  # the entry: its own copy of the tokenizer (APIs are not relayed)
            args = ["--models", str(model_dir.parent)]
        nodes.append(swarm.new_node(site, args=args, site=site))
    try:
        await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
        await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=START_TIMEOUT_S)
    except SwarmError as exc:
        pytest.fail(str(exc))
    return nodes


def relayed(home: list[LocalNode], lab: Lab) -> Callable[[Views], bool]:
    """A check: each home node's own record says `relayed`, at a public relay."""
    public = {lab.address("a"), lab.address("b")}

    def check(views: Views) -> bool:
        for node in home:
            document = views.get(node.name) or {}
            own = next((m for m in document.get("members", []) if m["self"]), None)
            record = (own or {}).get("record") or {}
            control = (record.get("addresses") or {}).get("control", "")
            if record.get("reach") != "relayed" or not any(h in control for h in public):
                return False
        return True

    return check


async def test_two_home_nodes_behind_nat_serve_a_chat_through_relays(
    make_lab: MakeLab,  # noqa: F811 - the fixture
    model_dir: Path,
    tmp_path: Path,
) -> None:
    lab = make_lab(SPEC)
    text, _ = reference_text(model_dir, MAX_TOKENS)
    async with LocalSwarm(tmp_path / "swarm", profile="local", lab=lab) as swarm:
        nodes: list[LocalNode] = []
        try:
            nodes = await start_sites(swarm, model_dir)
            home = nodes[2:]
            took = await wait_for(swarm, nodes, relayed(home, lab), RELAYED_TIMEOUT_S, "relayed")
            print(f"relayed {took:.1f} s after start")
            alive = all_see(nodes, nodes, "alive")
            joined = await wait_for(swarm, nodes, alive, RELAYED_TIMEOUT_S, "all members")
            print(f"all members {joined:.1f} s later")
            ready = model_ready(MODEL, nodes)
            covered = await wait_for(swarm, nodes, ready, COVERAGE_TIMEOUT_S, "cover")
            print(f"covered {covered:.1f} s later")
            assert await streamed_text(nodes[0]) == text
            for node in home:
                document = await swarm.status(node)
                assert document is not None
                says = document["reachability"]["says"]
                assert says.startswith("behind NAT: serving through relay tcp://10.77."), says
            relay = (await swarm.status(nodes[0]) or {})["relays"]["offered"]
            assert relay["sessions"] > 0 and relay["forwarded_bytes"] > 0
        except BaseException:
            print_logs(nodes)
            raise
