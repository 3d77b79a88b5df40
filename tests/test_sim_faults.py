"""Directed link faults: a one-way cut, and what each side comes to believe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from simulations.scenario import load_scenario, run_scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "simulations" / "scenarios"


def cut_scenario(count: int, to: list[Any], **membership: Any) -> dict[str, Any]:
    cut = {"kind": "cut", "from": [0], "to": to, "at": 5.0, "heal": 20.0}
    return {
        "duration": 40.0,
        "nodes": {"count": count},
        "membership": membership,
        "faults": [cut],
    }


def test_one_way_cut_b_suspects_a_while_a_keeps_b_alive() -> None:
    """Node 0's messages to everyone are lost; theirs reach it. Everyone
    declares node 0 dead; node 0, Lifeguard telling it that it is the likely
    culprit, declares nobody dead."""
    result = run_scenario(cut_scenario(10, [{"range": [1, 10]}]), seed=1)
    (cut,) = result["cuts"]
    assert (cut["from"], cut["to"], cut["start"], cut["heal"]) == (1, 9, 5.0, 20.0)
    assert cut["to_about_from"] == {"suspect": 9, "dead": 9}
    assert cut["from_about_to"]["dead"] == 0
    assert result["drops"]["network"]["cut"] > 0
    # After the heal, node 0 refutes and the swarm agrees again.
    assert result["view_agreement"] == 1.0


def test_a_one_way_cut_between_two_nodes_is_routed_around() -> None:
    """SWIM's indirect probes go through a third node: neither side of a
    single cut link suspects the other. Without helpers both do."""
    helped = run_scenario(cut_scenario(10, [1]), seed=1)["cuts"][0]
    assert helped["to_about_from"] == helped["from_about_to"] == {"suspect": 0, "dead": 0}
    alone = run_scenario(cut_scenario(10, [1], indirect_checks=0), seed=1)["cuts"][0]
    assert alone["to_about_from"]["suspect"] == 1
    assert alone["from_about_to"]["suspect"] == 1


def test_the_shipped_one_way_example_shows_the_asymmetry() -> None:
    scenario = load_scenario(SCENARIOS / "one-way.toml")
    (cut,) = run_scenario(scenario, seed=2)["cuts"]
    assert cut["to_about_from"]["dead"] == cut["to"] == 29
    assert cut["from_about_to"]["dead"] == 0


def test_helpers_outside_the_cut_keep_the_muted_node_alive() -> None:
    """Cut node 0 off from half the swarm only: the other half relays its
    acks (indirect probes), so nobody declares it dead."""
    (cut,) = run_scenario(cut_scenario(20, [{"range": [1, 10]}]), seed=1)["cuts"]
    assert cut["to_about_from"]["dead"] == 0
