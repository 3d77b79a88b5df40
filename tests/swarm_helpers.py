"""Shared steps of the real-process tests (nodes as subprocesses on loopback)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from runtime.cli.localswarm import LocalNode, LocalSwarm, SwarmError, Views, all_see
from runtime.model.tiny import make_tiny_model

START_TIMEOUT_S = 30.0
CONVERGE_TIMEOUT_S = 15.0
ADMIT_TIMEOUT_S = 60.0
"""Load and the doctor of a tiny model, on a loaded machine."""


async def wait_for(
    swarm: LocalSwarm,
    observers: Sequence[LocalNode],
    check: Callable[[Views], bool],
    timeout: float,
    what: str,
) -> float:
    """Poll the observers' status until `check(views)`; seconds it took."""
    try:
        return await swarm.wait_for(observers, check, timeout, what)
    except SwarmError as exc:
        pytest.fail(str(exc))


async def start_swarm(swarm: LocalSwarm, n: int, *, eligible: bool = True) -> list[LocalNode]:
    """`n` nodes joined through the first (the founder), all alive in
    everyone's view. `eligible`: the founder's operator makes every node
    eligible to vote, as one operator running them all would; without it
    only the founder ever votes."""
    nodes = [swarm.new_node() for _ in range(n)]
    await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
    await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=START_TIMEOUT_S)
    await wait_for(
        swarm, nodes, all_see(nodes, nodes, "alive"), CONVERGE_TIMEOUT_S, "full membership"
    )
    if eligible:
        try:
            await swarm.make_eligible(nodes[0], nodes[1:], timeout=START_TIMEOUT_S)
        except SwarmError as exc:
            pytest.fail(str(exc))
    return nodes


def serving(observer: LocalNode, model: str, nodes: Sequence[LocalNode]) -> Callable[[Views], bool]:
    """A wait_for check: `observer` routes over a complete `model` with
    every one of `nodes` in its coverage."""

    def check(views: Views) -> bool:
        coverage = (views.get(observer.name) or {}).get("coverage", {}).get(model)
        if coverage is None or coverage["gaps"]:
            return False
        return {node.node_id for node in nodes} <= {n["node_id"] for n in coverage["nodes"]}

    return check


async def assert_no_internal_errors(swarm: LocalSwarm, nodes: Sequence[LocalNode]) -> None:
    for name, view in (await swarm.views(nodes)).items():
        assert view is not None, f"{name} stopped answering"
        assert "node.internal_error" not in view["drops"], (name, view["drops"])


async def start_tiny_model_node(swarm: LocalSwarm, folder: Path, model: str) -> LocalNode:
    """One node serving the whole of a 4-layer tiny model named `model`
    (made in `folder`), started and admitted: chat can route to it."""
    model_dir = make_tiny_model(folder / model, layers=4, name=model)
    node = swarm.new_node(args=["--model", str(model_dir), "--layers", "0:4"])
    await swarm.start_ready(node, timeout=START_TIMEOUT_S)

    def admitted(views: Views) -> bool:
        coverage = (views.get(node.name) or {}).get("coverage", {}).get(model)
        return coverage is not None and not coverage["gaps"]

    await wait_for(swarm, [node], admitted, ADMIT_TIMEOUT_S, "the model admitted")
    return node


FAULT_HOOKS = Path(__file__).parent / "fault_hooks"


def fault_env(module: str, argument: str = "") -> dict[str, str]:
    """The environment that plants fault `module` (a file in
    tests/fault_hooks) in one node's process; see its sitecustomize."""
    path = os.pathsep.join(filter(None, [str(FAULT_HOOKS), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "SHARDMESH_TEST_FAULT": f"{module}:{argument}"}
