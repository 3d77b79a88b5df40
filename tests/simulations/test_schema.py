"""The scenario schema: every silent mistake a researcher made is now an error
naming the key, and what a scenario says is what runs."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from simulations.scenario import load_scenario, run_scenario
from simulations.schema import ScenarioError, render_schema, resolve
from tests import REPO

ROOT = REPO
SCENARIOS = ROOT / "simulations" / "scenarios"
DOCS = ROOT / "docs" / "simulation.md"
GENERATED = "<!-- generated: shardmesh simulate --schema -->\n\n"


def membership(**top: Any) -> dict[str, Any]:
    """A small membership scenario, with `top` merged in."""
    return {"duration": 30.0, "nodes": {"count": 6}} | top


def placement(placement_table: dict[str, Any], **top: Any) -> dict[str, Any]:
    base = {
        "models": [{"name": "y", "layers": 4, "layer_gb": 1}],
        "workers": [{"memory_gb": 8, "models": ["y"]}],
    }
    return {"duration": 30.0, "placement": base | placement_table} | top


def partition(**keys: Any) -> dict[str, Any]:
    return {"kind": "partition", "at": 5.0, "heal": 20.0} | keys


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        # Each silent mistake reported against the simulator, now an error.
        (membership(duraton=60.0), "duraton: unknown key; the scenario allows name, duration"),
        (membership(netwrok={"loss": 0.1}), "netwrok: unknown key"),
        (
            membership(faults=[{"kind": "crash", "node": 1, "att": 5.0}]),
            r"faults\[0\]\.att: unknown",
        ),
        (
            membership(faults=[partition(groups=[["0-2"], ["3-5"]])]),
            r"faults\[0\]\.groups\[0\]\[0\]: '0-2' is not a node id; use \{range = \[0, 3\]\}",
        ),
        (membership(faults=[partition(oneway=True)]), r"faults\[0\]\.oneway: unknown key"),
        (membership(faults=[partition(**{"from": [0], "to": [1]})]), r"faults\[0\]\.from"),
        (
            membership(membership={"suspicion_multt": 4}),
            "membership.suspicion_multt: unknown key; membership allows profile, probe_interval",
        ),
        (
            placement({}, faults=[{"kind": "partition", "voters": "leadr", "at": 1.0}]),
            r'faults\[0\]\.voters: "leader" or an array',
        ),
        (
            placement({}, faults=[{"kind": "partition", "voters": [[0], [7]], "at": 1.0}]),
            r"faults\[0\]\.voters\[1\]\[0\]: voter 7 is not in 0\.\.2",
        ),
        (placement({}, network={"loss": 0.9}), r"\[network\] is not used by placement"),
        # Wrong types, impossible values and times.
        (membership(nodes={"count": "6"}), r"nodes\.count: '6' is not an integer"),
        (membership(nodes={"count": 0}), r"nodes\.count: 0 is not in \[1"),
        (membership(network={"loss": "high"}), r"network\.loss: 'high' is not a number"),
        (membership(network={"jitter_kind": "normal"}), "network.jitter_kind: 'normal' is not"),
        (membership(duration=-1.0), "duration: -1.0 must be positive"),
        (membership(faults=[{"kind": "crash", "node": 6}]), r"faults\[0\]\.node: node 6 is not"),
        (membership(faults=[{"kind": "crash", "node": 1, "at": 31.0}]), "after the run ends"),
        (membership(faults=[partition(heal=5.0)]), r"faults\[0\]\.heal: 5\.0 must be after"),
        (membership(faults=[{"kind": "crash", "at": 1.0}]), "say which node"),
        (membership(faults=[{"kind": "crash", "node": 1, "nodes": [2]}]), "say which node"),
        (membership(faults=[{"kind": "crash", "random": 6}]), r"random: 6 is more than"),
        (
            membership(faults=[{"kind": "crash", "nodes": [{"range": [4, 2]}]}]),
            r"range: \[4, 2\] is empty",
        ),
        (placement({"voters": 0}), r"placement\.voters: 0 is not in \[1"),
        (
            membership(network={"links": [{"from": [0], "to": [1], "loss": 1.5}]}),
            r"network\.links\[0\]\.loss: 1\.5 is not in \[0\.0, 1\.0\]",
        ),
        (
            membership(network={"links": [{"from": [0], "to": [9]}]}),
            r"network\.links\[0\]\.to\[0\]: node 9 is not in 0\.\.5",
        ),
        (
            placement({"demand": [{"model": "z", "per_minute": 1}]}),
            r"placement\.demand\[0\]\.model: 'z' is not a model",
        ),
        # Latency distributions and bandwidth, for the network and per link.
        (
            membership(network={"links": [{"from": [0], "to": [1], "jitter_kind": "pareto"}]}),
            r"network\.links\[0\]\.jitter_kind: 'pareto' is not one of uniform, lognormal",
        ),
        (
            membership(network={"links": [{"from": [0], "to": [1], "jitter_sigma": -1.0}]}),
            r"network\.links\[0\]\.jitter_sigma: -1\.0 is not in \[0\.0, inf\)",
        ),
        (
            membership(network={"links": [{"from": [0], "to": [1], "bandwidth": 0}]}),
            r"network\.links\[0\]\.bandwidth: 0\.0 must be positive",
        ),
        (
            membership(network={"links": [{"from": [0], "to": [1], "bandwidth": "1MB"}]}),
            r"network\.links\[0\]\.bandwidth: '1MB' is not a number",
        ),
        (membership(network={"bandwidth": -5.0}), r"network\.bandwidth: -5\.0 must be positive"),
        (membership(network={"jitter_sigma": -0.1}), r"network\.jitter_sigma: -0\.1 is not in"),
        (membership(network={"loss": 1.5}), r"network\.loss: 1\.5 is not in \[0\.0, 1\.0\]"),
        # Clock skews.
        (
            membership(faults=[{"kind": "skew", "node": 1, "at": 1.0}]),
            r"faults\[0\]: a skew needs a `rate`, a `jump` or both",
        ),
        (
            membership(faults=[{"kind": "skew", "node": 1, "rate": 0}]),
            r"faults\[0\]\.rate: 0\.0 must be positive",
        ),
        (
            membership(faults=[{"kind": "skew", "node": 1, "jump": -3.0}]),
            r"faults\[0\]\.jump: -3\.0 is not in \[0\.0, inf\)",
        ),
        (
            membership(faults=[{"kind": "skew", "node": 1, "rate": 2.0, "drift": 0.1}]),
            r"faults\[0\]\.drift: unknown key",
        ),
        (membership(faults=[{"kind": "skew", "rate": 2.0}]), "say which node"),
    ],
)
def test_each_mistake_is_an_error_naming_the_key(scenario: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        run_scenario(scenario, seed=1)


def test_defaults_are_filled_in_and_the_shipped_scenarios_resolve() -> None:
    resolved = resolve(membership(faults=[{"kind": "pause", "node": 2}]))
    assert resolved["name"] == "" and resolved["nodes"]["join"] == "preconverged"
    assert resolved["membership"] == {"profile": "lan"}  # overrides only where given
    assert resolved["faults"] == [{"kind": "pause", "at": 0.0, "duration": 10.0, "node": 2}]
    for path in sorted(SCENARIOS.glob("*.toml")):
        resolve(load_scenario(path))  # every example stays valid


def test_skews_and_link_distributions_resolve_with_their_defaults() -> None:
    link = {"from": [0], "to": [{"range": [1, 3]}], "jitter_kind": "lognormal", "bandwidth": 1e6}
    resolved = resolve(
        membership(
            network={"bandwidth": 5e5, "links": [link]},
            faults=[{"kind": "skew", "nodes": [1, 2], "rate": 2.0}],
        )
    )
    assert resolved["network"]["bandwidth"] == 5e5
    # A link holds what it sets; the rest stays the network's.
    assert resolved["network"]["links"] == [link | {"to": [1, 2], "both": True}]
    assert resolved["faults"] == [
        {"kind": "skew", "at": 0.0, "nodes": [1, 2], "rate": 2.0, "jump": 0.0}
    ]


def test_ranges_name_the_same_nodes_as_lists() -> None:
    """A partition by ranges runs exactly the experiment the lists describe."""
    by_list = membership(faults=[partition(groups=[[0, 1, 2], [3, 4, 5]])])
    by_range = membership(faults=[partition(groups=[[{"range": [0, 3]}], [{"range": [3, 6]}]])])
    crash_list = membership(faults=[{"kind": "crash", "nodes": [1, 2, 3], "at": 2.0}])
    crash_range = membership(faults=[{"kind": "crash", "nodes": [{"range": [1, 4]}], "at": 2.0}])
    assert resolve(by_range)["faults"] == resolve(by_list)["faults"]
    for ranged, listed in ((by_range, by_list), (crash_range, crash_list)):
        one, other = run_scenario(ranged, seed=3), run_scenario(listed, seed=3)
        # Written differently, resolved the same: the same run, the same digest.
        assert (
            one.pop("provenance")["resolved_sha256"] == other.pop("provenance")["resolved_sha256"]
        )
        assert one == other
    assert len(run_scenario(crash_range, seed=3)["detections"]) == 3


def test_metrics_carry_provenance_and_the_digest_covers_the_scenario(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text('name = "tiny"\nduration = 10.0\n[nodes]\ncount = 4\n')
    result = run_scenario(path, seed=2)
    about = result["provenance"]
    assert about["scenario_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert about["seed"] == 2 and about["shardmesh_version"]
    assert about["git_commit"] is None or len(about["git_commit"].split("+")[0]) == 40
    resolved = about["resolved"]
    assert resolved["nodes"] == {
        "count": 4, "join": "preconverged", "seeds": 1, "stagger": 0.01, "record_size": 1024
    }  # fmt: skip
    assert json.loads(json.dumps(about)) == about  # plain JSON, no infinities
    # Two scenarios whose runs trace the same events still differ in digest:
    # here only the name differs, and nothing the simulated nodes do.
    renamed = run_scenario(load_scenario(path) | {"name": "other"}, seed=2)
    assert renamed["trace_lines"] == result["trace_lines"]
    assert renamed["trace_digest"] != result["trace_digest"]


def test_the_reference_is_printed_by_the_cli_and_kept_in_the_docs() -> None:
    reference = render_schema()
    for key in ("`duration`", "`nodes.count`", "`network.loss`", "`placement.voters`"):
        assert key in reference
    printed = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "simulate", "--schema"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert printed == reference
    docs = DOCS.read_text()
    assert GENERATED in docs, "docs/simulation.md lost its generated reference"
    assert docs.split(GENERATED, 1)[1] == reference, (
        "docs/simulation.md is stale: regenerate its reference with `shardmesh simulate --schema`"
    )


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (partition(heal=math.inf, flap={"period": 5.0, "duty": 0.5}), "needs a `heal` time"),
        (partition(flap={"period": 5.0, "duty": 1.5}), r"flap\.duty: 1\.5 is not in"),
        (partition(flap={"period": 5.0}), r"flap\.duty: required"),
        ({"kind": "ring", "at": 1.0, "groups": [[0], [1], [2]]}, "at least 4 node sets"),
        ({"kind": "bridge", "at": 1.0, "groups": [[0, 1], [1, 2]]}, r"node 1 is already in set 0"),
        ({"kind": "bridge", "at": 1.0}, r"faults\[0\]\.groups: required"),
        ({"kind": "cut", "at": 1.0, "from": [0]}, r"faults\[0\]\.to: required"),
    ],
)
def test_link_fault_mistakes_name_the_key(fault: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        resolve(membership(faults=[fault]))
