"""`shardmesh demo` (what `make demo` runs): a local swarm on loopback.

It starts real node processes, prints who-sees-whom as the swarm converges,
SIGKILLs one node and shows every survivor declare it dead (against the
profile's documented bound), stops one node gracefully to show a `left`,
then stops the rest and checks they all exit 0. Every wait is bounded; any
failure prints the relevant node logs and exits 1.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from runtime.localswarm import (
    LocalNode,
    LocalSwarm,
    SwarmError,
    all_see,
    dead_bound,
    state_matrix,
)
from runtime.status import format_status

CONVERGE_TIMEOUT_S = 30.0
POLL_S = 0.2
# Slack on top of the documented bound for process scheduling and polling.
BOUND_SLACK_S = 2.0


def _say(text: str = "") -> None:
    print(text, flush=True)


async def watch(
    swarm: LocalSwarm,
    observers: Sequence[LocalNode],
    shown: Sequence[LocalNode],
    done: Callable[[dict[str, dict[str, Any] | None]], bool],
    timeout: float,
    started: float,
) -> float:
    """Poll the observers until `done(views)`, printing the state matrix each
    time it changes; returns seconds since `started`."""
    last = None
    with trio.move_on_after(timeout):
        while True:
            views = await swarm.views(observers)
            matrix = state_matrix(shown, views)
            if matrix != last and "\n" in matrix:  # a header alone says nothing
                _say(f"t+{trio.current_time() - started:5.2f}s")
                _say(matrix)
                last = matrix
            if done(views):
                return trio.current_time() - started
            await trio.sleep(POLL_S)
    raise SwarmError(f"condition not reached within {timeout:.1f}s")


async def demo(root: Path, nodes: int, profile: str) -> None:
    async with LocalSwarm(root, profile=profile) as swarm:
        members = [swarm.new_node() for _ in range(nodes)]
        try:
            await _demo(swarm, members, profile)
        except BaseException:
            for node in members:
                _say(f"--- log of {node.name} ({node.log_path}) ---")
                _say(node.log_tail(25))
            raise


async def _demo(swarm: LocalSwarm, members: list[LocalNode], profile: str) -> None:
    _say(f"starting {len(members)} nodes on 127.0.0.1 (profile {profile}) under {swarm.root}")
    _say("each joins through the node started before it; the matrix shows who sees whom")
    _say("(rows: observer, columns: subject; A alive S suspect D dead L left . unknown)")
    t0 = trio.current_time()
    started = trio.Event()

    async def start_all() -> None:
        previous: LocalNode | None = None
        for node in members:
            await swarm.start_ready(node, [previous.control] if previous else [])
            via = f" via {previous.name}" if previous else ""
            _say(
                f"  {node.name} {node.node_id[:12]} up{via}: control {node.control} api {node.api}"
            )
            previous = node
        started.set()

    everyone_alive = all_see(members, members, "alive")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start_all)
        took = await watch(
            swarm,
            members,
            members,
            lambda views: started.is_set() and everyone_alive(views),
            CONVERGE_TIMEOUT_S,
            t0,
        )
    _say(f"full membership at every node {took:.2f}s after the first start")
    _say()
    view = await swarm.status(members[0])
    assert view is not None
    _say(f"$ shardmesh status --api {members[0].api}")
    _say(format_status(view))

    victim, survivors = members[-1], members[:-1]
    bound = dead_bound(profile, len(members))
    _say()
    _say(f"SIGKILL {victim.name} ({victim.node_id[:12]}); documented bound {bound:.2f}s")
    t0 = trio.current_time()
    victim.kill()
    await victim.wait_exit(5)
    took = await watch(
        swarm,
        survivors,
        members,
        all_see(survivors, [victim], "dead"),
        bound + BOUND_SLACK_S,
        t0,
    )
    verdict = "within" if took <= bound else "OVER"
    _say(f"every survivor declared {victim.name} dead after {took:.2f}s ({verdict} {bound:.2f}s)")
    if took > bound:
        raise SwarmError(f"detection took {took:.2f}s, over the documented {bound:.2f}s")

    leaver, remaining = survivors[-1], survivors[:-1]
    _say()
    _say(f"SIGTERM {leaver.name}: a graceful leave")
    t0 = trio.current_time()
    leaver.signal(15)
    took = await watch(
        swarm, remaining, members, all_see(remaining, [leaver], "left"), CONVERGE_TIMEOUT_S, t0
    )
    code = await leaver.wait_exit(10)
    _say(f"every remaining node shows {leaver.name} left after {took:.2f}s; exit code {code}")
    if code != 0:
        raise SwarmError(f"{leaver.name} exited {code} after SIGTERM")

    _say()
    _say(f"stopping {', '.join(n.name for n in remaining)} (SIGTERM)")
    codes: dict[str, int] = {}

    async def stop(node: LocalNode) -> None:
        codes[node.name] = await swarm.stop(node)

    async with trio.open_nursery() as nursery:
        for node in remaining:
            nursery.start_soon(stop, node)
    _say("exit codes: " + ", ".join(f"{name}={code}" for name, code in sorted(codes.items())))
    if any(codes.values()):
        raise SwarmError("a node did not exit cleanly")


def run_demo(*, nodes: int = 5, profile: str = "local", keep: bool = False) -> int:
    """The body of `shardmesh demo`; returns the exit code."""
    root = Path(tempfile.mkdtemp(prefix="shardmesh-demo-"))
    try:
        trio.run(demo, root, nodes, profile)
    except (SwarmError, AssertionError) as exc:
        _say(f"demo FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        _say("demo interrupted")
        return 130
    finally:
        if keep:
            _say(f"state dirs and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    _say("demo ok")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo())
