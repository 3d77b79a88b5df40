"""The node's HTTP API, served by a real node process."""

from __future__ import annotations

import httpx

from runtime.localswarm import LocalSwarm

CONTRACT_KEYS = {
    "node_id",
    "members",
    "leader",
    "term",
    "commit_index",
    "coverage",
    "ledger",
    "demand",
    "drops",
    "sessions",
}
MEMBER_KEYS = {"node_id", "state", "incarnation", "addr", "last_seen", "record"}


def assert_openai_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert "code" in error


async def test_status_document_and_errors(swarm: LocalSwarm) -> None:
    first, second = swarm.new_node(), swarm.new_node()
    await swarm.start_ready(first)
    await swarm.start_ready(second, [first.control])

    async with httpx.AsyncClient(base_url=first.api, timeout=5) as client:
        response = await client.get("/v1/network/status")
        assert response.status_code == 200
        doc = response.json()
        assert set(doc) >= CONTRACT_KEYS
        # The first node founded the Raft cluster: it leads, or is about to.
        assert doc["leader"] in (None, first.node_id)
        assert doc["ledger"] == [] and doc["demand"] == {} and doc["sessions"] == 0
        assert doc["hop"] is None  # it serves no shard
        assert doc["coverage"] == {}  # no node has a capability report yet
        for member in doc["members"]:
            assert set(member) >= MEMBER_KEYS
            assert member["state"] in {"alive", "suspect", "dead", "left"}
        me = next(m for m in doc["members"] if m["self"])
        assert me["node_id"] == first.node_id
        assert me["record"]["addresses"] == {
            "control": first.info["control"],
            "data": first.info["data"],
            "api": first.api,
        }

        response = await client.get("/v1/network/coverage")
        assert response.status_code == 200 and response.json() == {}
        unknown = await client.get("/v1/network/coverage", params={"model": "qwen3-8l"})
        assert_openai_error(unknown, 404)
        assert unknown.json()["error"]["code"] == "model_not_found"
        assert unknown.json()["error"]["param"] == "model"

        assert_openai_error(await client.get("/v1/nope"), 404)
        assert_openai_error(await client.get("/"), 404)
        assert_openai_error(await client.post("/v1/network/status"), 405)
