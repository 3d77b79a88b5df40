"""Real `shardmesh node` processes in a WAN lab (`runtime.lab`): five public
sites, 40 ms RTT between every pair and 1% loss on every link, `--profile wan`.

One test walks one swarm through it all, since pytest-trio gives every test
its own event loop and a swarm's processes and clients live in one: the
members converge; a chat entered at a node that serves nothing streams, over
a three-hop chain in three other sites, the text transformers' greedy
`generate` gives in this process; the Raft leader is SIGKILLed, another is
elected and every survivor sees it dead within the profile's bound
(`dead_bound`). From convergence to the end no node ever takes a live member
for dead. Root only: elsewhere it skips, saying why no lab can be built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
import trio

from runtime.cli.chat_client import sse_chunks
from runtime.cli.localswarm import LocalNode, LocalSwarm, SwarmError, all_see, dead_bound
from runtime.lab.netns import Lab
from runtime.model.tiny import make_tiny_model
from tests.processes.test_consensus import elected, leader_of
from tests.processes.test_inference import MESSAGES, MODEL, model_ready, reference_text
from tests.runtime.lab.fixtures import MakeLab, make_lab  # noqa: F401 - the fixture
from tests.swarm_helpers import assert_no_internal_errors, wait_for

SITES = ("a", "b", "c", "d", "e")
SPEC = {
    "seed": 29,
    "link": {"delay_ms": 10, "jitter_ms": 0, "loss": 0.01},
    "sites": [{"name": name} for name in SITES],
}
"""10 ms one way on every access link: 40 ms RTT between any two sites."""
SPANS = ("0:3", "3:6", "6:8")
"""The chain's hops, in sites a, b and c; d and e serve nothing."""
MAX_TOKENS = 24
START_TIMEOUT_S = 90.0
"""Five interpreters importing torch at once on a loaded 2-core machine
(lab nodes are spawned, never forked), then the wan profile's joins."""
CONVERGE_TIMEOUT_S = 30.0
COVERAGE_TIMEOUT_S = 60.0
"""Load and the doctor of each shard, and coverage gossiped over the WAN."""
FAILOVER_TIMEOUT_S = 30.0
QUIET_BEFORE_KILL_S = 30.0
"""At least this long of a converged, busy swarm before the kill; the
detection that follows (30 s or more) is watched too."""
WATCH_S = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / MODEL, layers=8, name=MODEL)


class DeathWatch:
    """Every time an observer took a running node for `suspect` or `dead`."""

    def __init__(self, swarm: LocalSwarm, nodes: Sequence[LocalNode]) -> None:
        self.swarm, self.nodes = swarm, nodes
        self.seen: dict[str, set[tuple[str, str]]] = {"suspect": set(), "dead": set()}
        self.since = trio.current_time()
        self.killed: set[str] = set()  # told before the kill, so no view races it

    async def run(self) -> None:
        while True:
            live = [n for n in self.nodes if n.running and n.name not in self.killed]
            views = await self.swarm.views(live)
            for observer in live:
                members = (views.get(observer.name) or {}).get("members", [])
                states = {m["node_id"]: m["state"] for m in members}
                for subject in live:
                    state = states.get(subject.node_id)
                    if subject is not observer and state in self.seen:
                        self.seen[state].add((observer.name, subject.name))
            await trio.sleep(WATCH_S)


async def start_in_sites(swarm: LocalSwarm, model_dir: Path) -> list[LocalNode]:
    """A serves 0:3 and founds the swarm; b, c serve the rest; d, e join bare."""
    nodes = []
    for i, site in enumerate(SITES):
        args = ["--model", str(model_dir), "--layers", SPANS[i]] if i < len(SPANS) else []
        nodes.append(swarm.new_node(site, args=args, site=site))
    try:
        await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
        await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=START_TIMEOUT_S)
        await swarm.make_eligible(nodes[0], nodes[1:], timeout=START_TIMEOUT_S)
    except SwarmError as exc:
        pytest.fail(str(exc))
    return nodes


async def streamed_text(node: LocalNode) -> str:
    """A greedy streamed chat entered at `node`: the content, chunk by chunk."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    body["stream"] = True
    url = node.api + "/v1/chat/completions"
    parts = []
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", url, json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for chunk in sse_chunks(r):
            for choice in chunk.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


async def kill_the_leader(
    swarm: LocalSwarm, nodes: list[LocalNode], watch: DeathWatch
) -> tuple[float, float]:
    """SIGKILL the leader: (seconds to a new leader, seconds to dead at all survivors)."""
    leader = await elected(swarm, nodes, len(nodes))
    survivors = [node for node in nodes if node is not leader]
    old_term = (await swarm.status(leader) or {})["term"]
    watch.killed.add(leader.name)
    leader.kill()
    await leader.wait_exit(5)
    failover = await wait_for(
        swarm,
        survivors,
        lambda views: (
            (new := leader_of(views, survivors)) is not None and views[new.name]["term"] > old_term
        ),
        FAILOVER_TIMEOUT_S,
        "a new leader",
    )
    bound = dead_bound("wan", len(nodes))
    dead = await wait_for(swarm, survivors, all_see(survivors, [leader], "dead"), bound, "dead")
    return failover, failover + dead


async def published_rtts_ms(swarm: LocalSwarm, nodes: Sequence[LocalNode]) -> list[float]:
    """The round trips (ms) every node's signed record says its membership
    probes measured to the other nodes, as the first node sees the records."""
    view = await swarm.status(nodes[0]) or {}
    others = {node.node_id for node in nodes}
    found = []
    for member in view.get("members", []):
        rtts = (member.get("record") or {}).get("rtt_us", {})
        found += [us / 1000 for peer, us in rtts.items() if peer in others]
    return found


def print_logs(nodes: Sequence[LocalNode]) -> None:
    for node in nodes:
        print(f"\n===== log of {node.name} ({node.log_path}) =====\n{node.log_tail(200)}")


@pytest.mark.slow
async def test_five_sites_40ms_apart_converge_chat_and_fail_over(
    make_lab: MakeLab,  # noqa: F811 - the fixture
    model_dir: Path,
    tmp_path: Path,
) -> None:
    lab: Lab = make_lab(SPEC)
    text, _ = reference_text(model_dir, MAX_TOKENS)
    async with LocalSwarm(tmp_path / "swarm", profile="wan", lab=lab) as swarm:
        nodes: list[LocalNode] = []
        try:
            nodes = await start_in_sites(swarm, model_dir)
            alive = all_see(nodes, nodes, "alive")
            await wait_for(swarm, nodes, alive, CONVERGE_TIMEOUT_S, "full membership")
            watch = DeathWatch(swarm, nodes)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch.run)
                await wait_for(swarm, nodes, model_ready(MODEL, nodes), COVERAGE_TIMEOUT_S, "cover")
                assert await streamed_text(nodes[3]) == text
                await trio.sleep_until(watch.since + QUIET_BEFORE_KILL_S)
                await assert_no_internal_errors(swarm, nodes)
                rtts = sorted(await published_rtts_ms(swarm, nodes))
                print(f"published round trips (ms): {rtts}")
                assert len(rtts) >= len(nodes), "every record names a measured round trip"
                assert min(rtts) >= 39 and 39 <= rtts[len(rtts) // 2] <= 60, rtts
                failover_s, dead_s = await kill_the_leader(swarm, nodes, watch)
                nursery.cancel_scope.cancel()
            watched = trio.current_time() - watch.since
            print(f"new leader {failover_s:.1f} s, dead {dead_s:.1f} s, watched {watched:.0f} s")
            print(f"suspicions of live members: {sorted(watch.seen['suspect'])}")
            assert not watch.seen["dead"], f"live members taken for dead: {watch.seen['dead']}"
            assert math.isfinite(dead_s)
        except BaseException:
            print_logs(nodes)
            raise
