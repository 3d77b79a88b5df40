"""Demand placement through real node processes on loopback (ADR-0026).

Node A is pinned by its operator to model X; node B starts model-less with
model Y in its store. A chat request for Y gets `503 model_loading`; the
leader places Y on B as a managed assignment; B loads it and passes its
doctor; a retried request succeeds; A's pinned assignment never changes. A
model that only a pinned node holds has no spare capacity to go to, and the
503 says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.localswarm import LocalNode, LocalSwarm, Views
from runtime.tinymodel import make_tiny_model
from tests.swarm_helpers import START_TIMEOUT_S, assert_no_internal_errors, wait_for

PLACE_TIMEOUT_S = 60.0
MESSAGES = [{"role": "user", "content": "hello"}]


def ledger_entry(view: dict[str, Any] | None, node: LocalNode) -> dict[str, Any] | None:
    for entry in (view or {}).get("ledger", []):
        if entry["node_id"] == node.node_id:
            return entry
    return None


async def ask(client: httpx.AsyncClient, node: LocalNode, model: str) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    return await client.post(node.api + "/v1/chat/completions", json=body)


@pytest.mark.slow
async def test_demand_places_a_model_on_spare_capacity_and_never_touches_pinned(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    x = make_tiny_model(tmp_path / "x", layers=8, name="x")
    store_a, store_b = tmp_path / "store-a", tmp_path / "store-b"
    make_tiny_model(store_a / "z", layers=8, seed=5, name="z")
    make_tiny_model(store_b / "y", layers=8, seed=2, name="y")
    a = swarm.new_node("a", args=["--model", str(x), "--layers", "0:8", "--models", str(store_a)])
    b = swarm.new_node("b", args=["--models", str(store_b)])
    await swarm.start_ready(a, timeout=START_TIMEOUT_S)
    await swarm.start_ready(b, [a.control], timeout=START_TIMEOUT_S)

    def pinned_recorded(views: Views) -> bool:
        entry = ledger_entry(views["a"], a)
        return entry is not None and entry["model"] == "x" and entry["tier"] == "operator"

    await wait_for(swarm, [a], pinned_recorded, PLACE_TIMEOUT_S, "A's pinned shard in the ledger")
    pinned = ledger_entry(await swarm.status(a), a)

    async with httpx.AsyncClient(timeout=60) as client:
        first = await ask(client, a, "y")
        assert first.status_code == 503, first.text
        assert first.headers["retry-after"]
        error = first.json()["error"]
        assert error["type"] == "model_loading"
        assert error["coverage"]["model"] == "y" and error["coverage"]["covered"] == []
        assert error["coverage"]["waiting_for"] and error["coverage"]["reason"]

        def placed(views: Views) -> bool:
            entry = ledger_entry(views["a"], b)
            return entry is not None and entry["model"] == "y"

        await wait_for(swarm, [a], placed, PLACE_TIMEOUT_S, "a managed assignment for B")
        entry = ledger_entry(await swarm.status(a), b)
        assert entry is not None
        assert entry["tier"] == "managed" and entry["managed"] is True
        assert entry["layers"] == [0, 8]

        def served(views: Views) -> bool:
            coverage = (views["a"] or {}).get("coverage", {}).get("y")
            return bool(coverage) and not coverage["gaps"]

        await wait_for(swarm, [a], served, PLACE_TIMEOUT_S, "B admitted for y")
        retried = await ask(client, a, "y")
        assert retried.status_code == 200, retried.text
        assert retried.json()["shardmesh"]["route"] == [b.node_id]

        # z is only in the store of A, which is pinned: no spare capacity.
        refused = await ask(client, a, "z")
        assert refused.status_code == 503
        await wait_for(
            swarm,
            [a],
            lambda views: (views["a"] or {}).get("placement", {}).get("waiting", {}).get("z")
            == "no_spare_capacity",
            PLACE_TIMEOUT_S,
            "z explained",
        )
        refused = await ask(client, a, "z")
        assert refused.json()["error"]["coverage"]["waiting_for"] == "no_spare_capacity"

    view = await swarm.status(a)
    assert ledger_entry(view, a) == pinned  # never retargeted, same epoch
    assert view["demand"]["y"]["count"] >= 2 and view["demand"]["z"]["count"] >= 1
    await assert_no_internal_errors(swarm, [a, b])
