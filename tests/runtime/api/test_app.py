"""The node's HTTP API: the app put together in process (`create_app`), then
served by a real node process."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any, cast

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from consensus.settings import PlacementSettings, policy_json
from runtime.api.app import NodeAPI, create_app
from runtime.cli.localswarm import LocalSwarm, Views
from runtime.inference.chat import ChatError, ChatRequest
from runtime.node.twin import TWIN_STARTUP_WINDOW_S
from tests.runtime.api.inprocess import leading_node

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
SETTINGS = {"idle_release_s": 5, "max_copies": 2, "max_admission_backoff_s": 100}
MEMBER_KEYS = {"node_id", "state", "incarnation", "addr", "last_seen", "record"}


def assert_openai_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert "code" in error


class NoModels:
    """A `ChatService` that knows one model and can load none of them."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()

    async def start(self, request: ChatRequest) -> Any:
        raise ChatError(404, f"no model {request.model!r}", code="model_not_found", param="model")

    def models(self) -> list[dict[str, Any]]:
        return [{"id": "m", "object": "model", "owned_by": "shardmesh"}]


async def test_the_app_serves_every_modules_routes_and_every_error_in_openai_shape(
    tmp_path: Path,
) -> None:
    chat = NoModels()
    async with leading_node(tmp_path, chat=chat) as node:
        app = create_app(cast(NodeAPI, node))
        paths = {getattr(route, "path", None) for route in app.routes}
        served = {"/v1/chat/completions", "/v1/models", "/v1/network/status", "/metrics", "/"}
        assert served <= paths
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            models = await client.get("/v1/models")
            assert models.json() == {"object": "list", "data": chat.models()}
            assert (await client.get("/")).headers["content-type"].startswith("text/html")
            missing = await client.get("/v1/nope")
            assert_openai_error(missing, 404)
            assert missing.json()["error"]["message"] == "no such endpoint: GET /v1/nope"
            wrong = await client.delete("/v1/network/status")
            assert_openai_error(wrong, 405)
            assert "DELETE is not allowed" in wrong.json()["error"]["message"]
            body = {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]}
            unknown = await client.post("/v1/chat/completions", json=body)
            assert_openai_error(unknown, 404)
            assert unknown.json()["error"]["param"] == "model"
            malformed = await client.post(
                "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
            )
            assert_openai_error(malformed, 400)
            # A bug (this node's status lacks what /metrics reads): a 500 that
            # names the exception, in the same shape, never a traceback.
            broken = await client.get("/metrics")
            assert_openai_error(broken, 500)
            assert broken.json()["error"] == {
                "message": "internal error: KeyError",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
    assert chat.outcomes == Counter({"model_not_found": 1, "client_error": 1})


async def test_status_document_and_errors(swarm: LocalSwarm) -> None:
    first, second = swarm.new_node(), swarm.new_node()
    await swarm.start_ready(first)
    await swarm.start_ready(second, [first.seed])

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
        addresses = dict(me["record"]["addresses"])
        # A reachable node offers to relay by default (docs/design/relays.md).
        assert addresses.pop("relay").startswith("tcp://127.0.0.1:")
        assert addresses == {
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
        assert_openai_error(await client.post("/"), 405)
        assert_openai_error(await client.post("/v1/network/status"), 405)

        # The web page: static files whose script reads the status document.
        page = await client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        script = await client.get("/web/page.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert 'fetch("/v1/network/status"' in script.text
        for html_sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
            assert html_sink not in script.text  # peers' strings are only ever set as text

        # Prometheus metrics: the same figures as the status, in its format.
        scraped = await client.get("/metrics")
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
        values = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(scraped.text)
            for sample in family.samples
        }
        assert values[("shardmesh_members", (("state", "alive"),))] >= 1  # itself, at least
        assert values[("shardmesh_raft_term", ())] >= 1
        assert ("shardmesh_sessions", ()) in values


async def test_the_swarm_policy_is_shown_changed_and_bad_settings_are_refused(
    swarm: LocalSwarm,
) -> None:
    node = swarm.new_node()
    await swarm.start_ready(node)

    async with httpx.AsyncClient(base_url=node.api, timeout=15) as client:
        shown = (await client.get("/v1/network/policy")).json()  # reads are public
        client.headers.update(node.admin_headers())  # changes carry the operator token
        assert shown["settings"] == {}
        assert shown["policy"] == policy_json(PlacementSettings())

        refusals = [
            (b"[1]", None),
            (b"{not json", None),
            (b"{}", None),
            (b'{"sudo": 1}', "sudo"),
            (b'{"max_copies": 1.5}', "max_copies"),
            (b'{"idle_release_s": -1}', "idle_release_s"),
            (b'{"idle_release_s": "4"}', "idle_release_s"),
            (b'{"idle_release_s": NaN}', "idle_release_s"),
            (b'{"cooldown_s": true}', "cooldown_s"),
            (b'{"admission_backoff_s": 7200}', "admission_backoff_s"),  # above its ceiling
        ]
        for body, param in refusals:
            response = await client.post(
                "/v1/network/policy", content=body, headers={"content-type": "application/json"}
            )
            assert_openai_error(response, 400)
            assert response.json()["error"]["param"] == param, body

        # The node founded the cluster, so it leads once it has campaigned.
        with trio.fail_after(10):
            while (
                changed := await client.post("/v1/network/policy", json=SETTINGS)
            ).status_code == 503:
                await trio.sleep(0.1)
        assert changed.status_code == 200, changed.text
        assert changed.json()["accepted"] is True
        assert changed.json()["settings"] == {
            "idle_release_s": 5.0,
            "max_admission_backoff_s": 100.0,
            "max_copies": 2,
        }
        policy = changed.json()["policy"]
        assert (policy["idle_release_s"], policy["max_copies"]) == (5.0, 2)
        assert policy["cooldown_s"] == PlacementSettings().cooldown_s

        # Valid alone, but not with the ceiling just set: refused before it is proposed.
        clash = await client.post("/v1/network/policy", json={"admission_backoff_s": 200})
        assert_openai_error(clash, 400)
        assert "with the settings in force" in clash.json()["error"]["message"]

        status = (await client.get("/v1/network/status")).json()
        assert status["policy_settings"] == changed.json()["settings"]
        assert status["placement"]["policy"] == policy
        assert status["ledger_rejected"] == {}  # every refusal stopped at the API
        assert (await client.get("/v1/network/policy")).json()["settings"] == changed.json()[
            "settings"
        ]


async def test_a_join_nobody_answers_is_logged_and_shown(swarm: LocalSwarm) -> None:
    """A wrong --join (here: the right address, the wrong id, so the
    encrypted handshake fails) leaves the node alone: it says so in its log
    and its status instead of running silently, and keeps trying."""
    first = swarm.new_node()
    await swarm.start_ready(first)
    wrong = f"{'ab' * 32}@{first.control}"
    lost, joined = swarm.new_node(), swarm.new_node()
    await swarm.start_ready(lost, [wrong])
    await swarm.start_ready(joined, [first.seed])

    def states(views: Views) -> bool:
        lost_join = (views.get(lost.name) or {}).get("join", {})
        joined_join = (views.get(joined.name) or {}).get("join", {})
        return lost_join.get("attempts", 0) >= 3 and joined_join.get("state") == "joined"

    await swarm.wait_for([lost, joined], states, 15.0, "join states")
    view = (await swarm.views([lost]))[lost.name]
    assert view is not None
    assert view["join"]["state"] == "no peer reached" and view["join"]["seeds"] == [wrong]
    first_view = (await swarm.views([first]))[first.name]
    assert first_view is not None and first_view["join"] == {
        "state": "founded",
        "seeds": [],
        "attempts": 0,
    }
    assert f"no answer from {wrong}" in lost.log_tail(200)


async def test_a_copied_state_dir_stops_the_copy_not_the_node(swarm: LocalSwarm) -> None:
    """Two processes with one key would fight over one id (each outbidding
    the other's incarnation) and the swarm would move it between addresses.
    The newcomer notices the running twin within moments and stops, with
    one line; the node it copied keeps serving."""
    seed, original = swarm.new_node(), swarm.new_node()
    await swarm.start_ready(seed)
    await swarm.start_ready(original, [seed.seed])
    # The original is established (older than the profile's window; see
    # runtime.node.twin.TWIN_STARTUP_WINDOW_S) when the copy starts.
    await trio.sleep(TWIN_STARTUP_WINDOW_S["local"] + 0.5)
    copy = swarm.new_node("copy")
    # Copied while it runs, as a careless backup-and-restore would; the
    # lock and ready files are per process and stay behind.
    shutil.copytree(
        original.state_dir, copy.state_dir, ignore=shutil.ignore_patterns("lock", "node.json")
    )
    await swarm.start(copy, [seed.seed])
    assert copy.process is not None
    with trio.move_on_after(30):
        await copy.process.wait()
    assert copy.process.returncode == 1, (copy.log_tail(), original.log_tail())
    assert f"node {original.node_id} is already alive at" in copy.log_tail(5)
    assert original.running

    def original_alive(views: Views) -> bool:
        members = (views.get(seed.name) or {}).get("members", [])
        states = {m["node_id"]: (m["state"], m["addr"]) for m in members}
        return states.get(original.node_id) == ("alive", original.info["control"])

    await swarm.wait_for([seed], original_alive, 15.0, "the original alive where it is")
