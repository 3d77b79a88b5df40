"""Reachability with real `shardmesh node` processes: on loopback, and across the WAN lab.

On loopback two nodes learn they are reachable at their advertised address.
In the lab (network namespaces): two public sites and two home sites, each
behind its own NAT router: `c`'s port-preserving, `d`'s symmetric (neither
lets an unasked connection in).
The founder is in `a`; `b`, `c` and `d` join it. The public nodes learn
they are reachable at their own address; each home node, whose requests go
out through its router but whose private address no peer can dial, learns
it is behind NAT, and `shardmesh status` says so in words, and then which
relay it is served through (`runtime.node.relays`). The lab test needs
root: elsewhere it skips, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mesh.relay import RELAY_PORT_OFFSET
from runtime.cli.localswarm import LocalSwarm, Views
from runtime.lab.netns import Lab
from runtime.node.state_dir import READY_FILE
from tests.runtime.lab.fixtures import MakeLab, make_lab  # noqa: F401 - the fixture
from tests.swarm_helpers import start_swarm, wait_for

CONTROL_PORT = 7001
API_PORT = 8001
START_TIMEOUT_S = 60.0
"""Four interpreters starting at once on a loaded 2-core machine."""
VERDICT_TIMEOUT_S = 30.0
"""The first round after a second, a dial-back's two-second timeout, a
silent prober's five-second wait, and the local profile declaring the home
node dead (so a public node stops counting it among those to ask)."""
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


async def test_two_nodes_on_loopback_learn_they_are_reachable(swarm: LocalSwarm) -> None:
    nodes = await start_swarm(swarm, 2, eligible=False)

    def both_direct(views: Views) -> bool:
        verdicts = [(views.get(n.name) or {}).get("reachability", {}) for n in nodes]
        return all(v.get("verdict") == "direct" for v in verdicts)

    took = await wait_for(swarm, nodes, both_direct, VERDICT_TIMEOUT_S, "both reachable")
    for one in nodes:
        document = await swarm.status(one)
        assert document is not None
        control = document["addresses"]["control"]
        assert document["reachability"]["says"] == f"reachable at {control}"
        own = next(m for m in document["members"] if m["self"])
        assert own["record"]["reach"] == "direct"
    print(f"both direct {took:.1f}s after the swarm converged")


def start(lab: Lab, site: str, state: Path, join: str | None) -> str:
    """Start a node in `site`; its node id once it is up."""
    host = lab.address(site)
    argv = [
        sys.executable, "-m", "runtime.cli", "node",
        "--listen", f"{host}:{CONTROL_PORT}", "--api", f"{host}:{API_PORT}",
        "--state-dir", str(state), "--profile", "local", "--log-level", "INFO",
    ]  # fmt: skip
    if join is not None:
        argv += ["--join", join]
    with (state.parent / f"{site}.log").open("wb") as log:  # the child keeps its own copy
        lab.spawn(site, argv, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return str(json.loads((state / READY_FILE).read_text())["node_id"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.1)
    tail = (state.parent / f"{site}.log").read_text(errors="replace")[-2000:]
    pytest.fail(f"node in {site} not up in {START_TIMEOUT_S}s; its log ends:\n{tail}")


def status(lab: Lab, site: str, *, as_json: bool) -> Any:
    """`shardmesh status` run inside `site`, against its own node."""
    api = f"{lab.address(site)}:{API_PORT}"
    argv = [sys.executable, "-m", "runtime.cli", "status", "--api", api]
    done = subprocess.run(
        lab.command(site, [*argv, *(["--json"] if as_json else [])]),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).parents[2],
        check=False,
    )
    if done.returncode != 0:
        return None
    return json.loads(done.stdout) if as_json else done.stdout


def wait_verdicts(lab: Lab, want: dict[str, str]) -> dict[str, Any]:
    deadline = time.monotonic() + VERDICT_TIMEOUT_S
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for site in want:
            document = status(lab, site, as_json=True)
            if document is not None:
                seen[site] = document["reachability"]
        if all(seen.get(site, {}).get("verdict") == verdict for site, verdict in want.items()):
            return seen
        time.sleep(0.5)
    pytest.fail(f"verdicts not reached in {VERDICT_TIMEOUT_S}s: want {want}, saw {seen}")


def wait_relayed(lab: Lab, site: str) -> dict[str, Any]:
    """`site`'s status once its own record says it is reached through a relay."""
    deadline = time.monotonic() + VERDICT_TIMEOUT_S
    while time.monotonic() < deadline:
        document = status(lab, site, as_json=True)
        own = next((m for m in (document or {}).get("members", []) if m["self"]), None)
        if own is not None and (own["record"] or {}).get("reach") == "relayed":
            return dict(document)
        time.sleep(0.5)
    pytest.fail(f"{site} not relayed within {VERDICT_TIMEOUT_S}s")


def test_public_nodes_learn_they_are_direct_and_a_home_node_that_it_is_behind_nat(
    make_lab: MakeLab,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    lab = make_lab(SPEC)
    founder = start(lab, "a", tmp_path / "a", None)
    seed = f"{founder}@{lab.address('a')}:{CONTROL_PORT}"
    start(lab, "b", tmp_path / "b", seed)
    start(lab, "c", tmp_path / "c", seed)
    start(lab, "d", tmp_path / "d", seed)
    began = time.monotonic()
    want = {"a": "direct", "b": "direct", "c": "unreachable", "d": "unreachable"}
    seen = wait_verdicts(lab, want)
    took = time.monotonic() - began
    for site in ("a", "b"):
        address = f"tcp://{lab.address(site)}:{CONTROL_PORT}"
        assert seen[site]["says"].startswith(f"reachable at {address}")
    for site in ("c", "d"):
        home = f"tcp://{lab.address(site)}:{CONTROL_PORT}"
        says = seen[site]["says"]
        assert says.startswith("behind NAT: "), says
        assert f"peers cannot dial {home}" in says
        document = wait_relayed(lab, site)
        relay = document["reachability"]["relay"]
        says = f"behind NAT: serving through relay {relay} (peers cannot dial {home})"
        assert document["reachability"]["says"] == says
        assert relay in {f"tcp://{lab.address(s)}:{CONTROL_PORT + RELAY_PORT_OFFSET}" for s in "ab"}
        assert f"reachability: {says}" in status(lab, site, as_json=False)
    public = status(lab, "b", as_json=True)
    own = next(m for m in public["members"] if m["self"])
    assert own["record"]["reach"] == "direct"
    print(f"verdicts in {took:.1f}s after the last start")
