"""Every member sees every node's load (issue 16's swarm page): a node
republishes its open-session count in its signed record when it changes,
at most every LOAD_PUBLISH_S, and another node's status (which the page
draws) carries it.

Real node processes on loopback: an entry holding the first half of a tiny
model and a hop holding the second, planted with a fault that makes each of
its forwards 50 ms slower so a streamed answer keeps its session open for
seconds. While the stream runs, the entry's status shows the hop's record
with the session open; after it ends, back to none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm
from runtime.model.tiny import make_tiny_model
from runtime.node.record_publisher import LOAD_PUBLISH_S
from tests.swarm_helpers import ADMIT_TIMEOUT_S, START_TIMEOUT_S, fault_env, serving, wait_for

MODEL = "tiny"
STEP_DELAY_S = 0.05
MAX_TOKENS = 300
"""About 15 s of decoding at the hop's planted pace: several publish periods."""
SEEN_WITHIN_S = 3 * LOAD_PUBLISH_S
"""A publish period, then a gossip spread on the local profile (well under
a second), with room for a loaded machine."""


def hop_sessions(observer: LocalNode, hop: LocalNode) -> Any:
    """A wait_for check: the hop's published session count, as `observer` sees it."""

    def sessions(views: dict[str, Any]) -> int | None:
        for member in (views.get(observer.name) or {}).get("members", []):
            if member["node_id"] == hop.node_id:
                return (member["record"] or {}).get("sessions")
        return None

    return sessions


@pytest.mark.slow
async def test_a_nodes_open_sessions_reach_the_other_members(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    model_dir = make_tiny_model(tmp_path / "models" / MODEL, layers=4, name=MODEL)
    entry = swarm.new_node("entry", args=["--model", str(model_dir), "--layers", "0:2"])
    hop = swarm.new_node(
        "hop",
        args=["--model", str(model_dir), "--layers", "2:4"],
        env=fault_env("slow_hop", str(STEP_DELAY_S)),
    )
    await swarm.start_ready(entry, timeout=START_TIMEOUT_S)
    await swarm.start_many([hop], [entry.seed], timeout=START_TIMEOUT_S)
    await wait_for(swarm, [entry], serving(entry, MODEL, [entry, hop]), ADMIT_TIMEOUT_S, "chain")
    sessions = hop_sessions(entry, hop)
    await wait_for(swarm, [entry], lambda v: sessions(v) == 0, SEEN_WITHIN_S, "idle hop")

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Keep talking."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    finished = trio.Event()

    async def stream() -> None:
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", entry.api + "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            async for _line in response.aiter_lines():
                pass
        finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        await wait_for(swarm, [entry], lambda v: sessions(v) == 1, SEEN_WITHIN_S, "busy hop")
        assert not finished.is_set(), "the stream ended before its load was seen"
    await wait_for(swarm, [entry], lambda v: sessions(v) == 0, SEEN_WITHIN_S, "idle again")
