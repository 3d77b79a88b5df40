"""Shared steps of the real-process tests (nodes as subprocesses on loopback)."""

from __future__ import annotations

import collections
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mesh.config import MembershipConfig
from mesh.identity import Identity
from mesh.transport import CONTROL_MAX_MESSAGE_BYTES, Plane, open_plane
from runtime.cli.localswarm import LocalNode, LocalSwarm, SwarmError, Views, all_see, member_field
from runtime.model.tiny import make_tiny_model
from runtime.node.membership_driver import MembershipDriver
from runtime.node.state_dir import StateDir

START_TIMEOUT_S = 30.0
CONVERGE_TIMEOUT_S = 15.0
ADMIT_TIMEOUT_S = 60.0
"""Load and the doctor of a tiny model, on a loaded machine."""
OBSERVATION_SLACK_S = 0.5
"""A detection is observed by polling every node's API, so it is seen up to
one poll round (sleep + concurrent HTTP fetches) after it happened."""


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


def control_plane(identity: Identity, drops: collections.Counter[str]) -> Any:
    """An attacker's own control plane on loopback (an async context)."""
    return open_plane(
        "tcp://127.0.0.1:0",
        name="control",
        max_message_bytes=CONTROL_MAX_MESSAGE_BYTES,
        drops=drops,
        keys=identity.plane_keys(),
    )


@asynccontextmanager
async def joined_attacker(
    swarm: LocalSwarm, nodes: Sequence[LocalNode], folder: Path
) -> AsyncIterator[tuple[Identity, Plane]]:
    """A fresh key that really joined through `nodes[0]` and answers probes
    throughout (a member attacker): alive on every node when this yields
    its identity and control plane."""
    member = Identity.generate()
    drops: collections.Counter[str] = collections.Counter()
    async with control_plane(member, drops) as plane, trio.open_nursery() as nursery:
        with StateDir(folder) as state:
            attacker = MembershipDriver(
                identity=member,
                state=state,
                config=MembershipConfig.local(),
                plane=plane,
                address=plane.address,
                incarnation=0,
                on_consensus=lambda sender, payload: None,
            )
            nursery.start_soon(attacker.run)
            attacker.join([(bytes.fromhex(nodes[0].node_id), nodes[0].info["control"])])

            def admitted(views: Views) -> bool:
                return all(
                    member_field(view, member.node_id.hex(), "state") == "alive"
                    for view in views.values()
                )

            await wait_for(swarm, nodes, admitted, CONVERGE_TIMEOUT_S, "the attacker a member")
            yield member, plane
            nursery.cancel_scope.cancel()


async def crash_and_time_death(
    swarm: LocalSwarm, victim: LocalNode, survivors: Sequence[LocalNode], bound: float, what: str
) -> float:
    """SIGKILLs `victim` (no leave announced) and waits until every survivor
    holds it dead: the seconds that took, failing late enough past `bound`
    to report the time."""
    t0 = trio.current_time()
    victim.kill()
    assert await victim.wait_exit(5) == -signal.SIGKILL
    await wait_for(
        swarm,
        survivors,
        all_see(survivors, [victim], "dead"),
        bound + OBSERVATION_SLACK_S + 5.0,
        what,
    )
    return float(trio.current_time() - t0)


async def verify_every_request(entry: LocalNode) -> None:
    """The operator's policy on `entry`: spot-check every finished request
    (`verify_fraction` 1), so a liar scenario is short."""
    async with httpx.AsyncClient(timeout=START_TIMEOUT_S) as client:
        reply = await client.post(
            entry.api + "/v1/network/policy",
            json={"verify_fraction": 1.0},
            headers=entry.admin_headers(),
        )
    assert reply.status_code == 200, reply.text
