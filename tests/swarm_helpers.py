"""Shared steps of the real-process tests (nodes as subprocesses on loopback)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from runtime.cli.localswarm import LocalNode, LocalSwarm, SwarmError, Views, all_see

START_TIMEOUT_S = 30.0
CONVERGE_TIMEOUT_S = 15.0


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


async def start_swarm(swarm: LocalSwarm, n: int) -> list[LocalNode]:
    nodes = [swarm.new_node() for _ in range(n)]
    await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
    await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=START_TIMEOUT_S)
    await wait_for(
        swarm, nodes, all_see(nodes, nodes, "alive"), CONVERGE_TIMEOUT_S, "full membership"
    )
    return nodes


async def assert_no_internal_errors(swarm: LocalSwarm, nodes: Sequence[LocalNode]) -> None:
    for name, view in (await swarm.views(nodes)).items():
        assert view is not None, f"{name} stopped answering"
        assert "node.internal_error" not in view["drops"], (name, view["drops"])
