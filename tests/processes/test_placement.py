"""Demand placement through real node processes on loopback (ADR-0026).

Node A is pinned by its operator to model X; node B starts model-less with
model Y in its store. A chat request for Y gets `503 model_loading`; the
leader places Y on B as a managed assignment; B loads it and passes its
doctor; a retried request succeeds; A's pinned assignment never changes. A
model that only a pinned node holds has no spare capacity to go to, and the
503 says so.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import SafetensorsReader
from tests.swarm_helpers import START_TIMEOUT_S, assert_no_internal_errors, wait_for

PLACE_TIMEOUT_S = 60.0
IDLE_RELEASE_S = 8.0
"""Short, but longer than loading a tiny shard and its doctor on a loaded
2-core machine: the idle clock starts when the model is placed, and the
test asks again only once the shard is served."""
MESSAGES = [{"role": "user", "content": "hello"}]


def ledger_entry(view: dict[str, Any] | None, node: LocalNode) -> dict[str, Any] | None:
    for entry in (view or {}).get("ledger", []):
        if entry["node_id"] == node.node_id:
            return entry
    return None


def decisions(views: Views) -> list[dict[str, Any]]:
    """Placement decisions from every view, in log order. A node remembers
    only what it decided as leader, and leadership may move during a test."""
    found = [
        d for view in views.values() for d in (view or {}).get("placement", {}).get("decisions", [])
    ]
    return sorted(found, key=lambda d: d["index"])


def knows_store(observer: LocalNode, holder: LocalNode, model: str) -> Callable[[Views], bool]:
    """`observer` has `holder`'s record (by gossip) and it lists `model`:
    until then the observer has never heard of the model (a 404, no demand)."""

    def check(views: Views) -> bool:
        for member in (views[observer.name] or {}).get("members", []):
            if member["node_id"] == holder.node_id:
                return model in ((member["record"] or {}).get("models") or [])
        return False

    return check


async def ask(client: httpx.AsyncClient, node: LocalNode, model: str) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    return await client.post(node.api + "/v1/chat/completions", json=body)


async def set_short_idle_release(swarm: LocalSwarm, via: LocalNode, nodes: list[LocalNode]) -> None:
    """`shardmesh policy --set` through `via` (a real CLI process): the
    setting is committed once and every node's replica holds it, so the
    release comes on time whichever node leads when it is due. `via` signs
    the call it forwards, and the leader takes admin calls only from voters:
    wait until `via` is one."""

    def via_votes(views: Views) -> bool:
        return via.node_id in (views[via.name] or {}).get("raft", {}).get("voters", [])

    await wait_for(swarm, [via], via_votes, PLACE_TIMEOUT_S, f"{via.name} a voter")
    cli = [sys.executable, "-m", "runtime.cli", "policy", "--api", via.api]
    cli += ["--state-dir", str(via.state_dir)]  # the operator token of the node asked
    with trio.fail_after(START_TIMEOUT_S):
        done = await trio.run_process(
            [*cli, "--set", f"idle_release_s={IDLE_RELEASE_S}", "--timeout", "20"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    shown = done.stdout.decode()
    assert shown.startswith("committed at index ") and "idle_release_s" in shown
    assert any(
        line.split() == ["idle_release_s", str(IDLE_RELEASE_S), "set"]
        for line in shown.splitlines()
    ), shown

    def everywhere(views: Views) -> bool:
        return all(
            (view or {}).get("policy_settings") == {"idle_release_s": IDLE_RELEASE_S}
            and view["placement"]["policy"]["idle_release_s"] == IDLE_RELEASE_S
            for view in views.values()
        )

    await wait_for(swarm, nodes, everywhere, PLACE_TIMEOUT_S, "the policy on every node")


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
    await swarm.start_ready(b, [a.seed], timeout=START_TIMEOUT_S)
    await swarm.make_eligible(a, [b], timeout=START_TIMEOUT_S)
    await set_short_idle_release(swarm, via=b, nodes=[a, b])
    await wait_for(swarm, [a], knows_store(a, b, "y"), PLACE_TIMEOUT_S, "B's store known to A")

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
        view = await swarm.status(a)
        entry = ledger_entry(view, b)
        assert entry is not None
        assert entry["tier"] == "managed" and entry["managed"] is True
        assert entry["layers"] == [0, 8]
        assert view["placement"]["cooldown_s"][b.node_id] > 0  # not retargetable yet

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
            lambda views: (
                (views["a"] or {}).get("placement", {}).get("waiting", {}).get("z")
                == "no_spare_capacity"
            ),
            PLACE_TIMEOUT_S,
            "z explained",
        )
        refused = await ask(client, a, "z")
        assert refused.json()["error"]["coverage"]["waiting_for"] == "no_spare_capacity"

    view = await swarm.status(a)
    assert ledger_entry(view, a) == pinned  # never retargeted, same epoch
    assert view["demand"]["y"]["count"] >= 2 and view["demand"]["z"]["count"] >= 1

    # Nobody asks for y any more: the leader releases B's managed shard.
    def released(views: Views) -> bool:
        return ledger_entry(views["a"], b) is None and "y" not in views["a"]["coverage"]

    await wait_for(swarm, [a], released, IDLE_RELEASE_S + PLACE_TIMEOUT_S, "idle release")
    views = await swarm.views([a, b])
    release = [d for d in decisions(views) if d["command"] == "Release"]
    assert release and release[-1]["code"] == "idle" and release[-1]["node_id"] == b.node_id
    assert ledger_entry(views["a"], a) == pinned
    await assert_no_internal_errors(swarm, [a, b])


@pytest.mark.slow
async def test_the_chat_cli_waits_while_demand_places_the_model_then_streams(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    make_tiny_model(store / "y", layers=8, seed=2, name="y")
    node = swarm.new_node("b", args=["--models", str(store)])
    await swarm.start_ready(node, timeout=START_TIMEOUT_S)
    cli = [sys.executable, "-m", "runtime.cli", "chat", "--api", node.api, "--model", "y"]
    options = ["--max-tokens", "8", "--temperature", "0", "--wait", str(PLACE_TIMEOUT_S)]
    with trio.fail_after(PLACE_TIMEOUT_S + 30):
        done = await trio.run_process(
            [*cli, *options, MESSAGES[0]["content"]],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    # Nothing held y before this request asked for it: the CLI was told so,
    # said what it waited for, and asked again until the answer came.
    assert "shardmesh chat: waiting for y: 0/8 layers served" in stderr, stderr
    assert "completion tokens; first token " in stderr  # timing from the final chunk
    assert "ms/token through 1 hop]" in stderr
    async with httpx.AsyncClient(timeout=60) as client:
        same = await ask(client, node, "y")
    assert same.status_code == 200, same.text
    assert done.stdout.decode() == same.json()["choices"][0]["message"]["content"] + "\n"

    # A name nobody has is no reason to wait: it fails at once, saying why.
    unknown = [*cli[:-1], "nope", "hello"]
    with trio.fail_after(10):
        refused = await trio.run_process(unknown, capture_stderr=True, check=False)
    assert refused.returncode == 1
    assert "404 model_not_found" in refused.stderr.decode()


@pytest.mark.slow
async def test_bootstrap_assignment_by_operator_and_by_auto_join(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    x = make_tiny_model(tmp_path / "x", layers=8, name="x")
    store_b, store_c = tmp_path / "store-b", tmp_path / "store-c"
    make_tiny_model(store_b / "y", layers=8, seed=2, name="y")
    make_tiny_model(store_c / "w", layers=8, seed=4, name="w")
    a = swarm.new_node("a", args=["--model", str(x), "--layers", "0:8"])
    b = swarm.new_node("b", args=["--models", str(store_b)])
    c = swarm.new_node("c", args=["--models", str(store_c), "--auto-join"])
    await swarm.start_ready(a, timeout=START_TIMEOUT_S)
    await swarm.start_many([b, c], [a.seed], timeout=START_TIMEOUT_S)
    await swarm.make_eligible(a, [b, c], timeout=START_TIMEOUT_S)

    async with httpx.AsyncClient(timeout=60) as client:
        # The suggestion for a joining node with y in its store.
        await wait_for(
            swarm,
            [b],
            lambda views: "y" in (views["b"] or {}).get("placement", {}).get("models", {}),
            PLACE_TIMEOUT_S,
            "y's size known",
        )
        suggestion = await client.post(
            b.api + "/v1/network/assign",
            json={"memory_bytes": 2**30, "models": ["y"]},
            headers=b.admin_headers(),
        )
        assert suggestion.status_code == 200, suggestion.text
        assert suggestion.json()["model"] == "y" and suggestion.json()["layers"] == [0, 8]
        nothing = await client.post(
            b.api + "/v1/network/assign",
            json={"memory_bytes": 2**30, "models": ["nope"]},
            headers=b.admin_headers(),
        )
        assert nothing.status_code == 404 and nothing.json()["error"]["code"] == "no_gap"

        # The operator assigns B on its first join, through a follower or not
        # (one that knows the leader: until then it answers 503 no_leader).
        await wait_for(
            swarm, [b], lambda views: (views["b"] or {}).get("leader") is not None,
            PLACE_TIMEOUT_S, "B knows the leader",
        )  # fmt: skip
        body = {"node_id": b.node_id, "model": "y", "layers": [0, 8], "recipe": "fp32"}
        with trio.move_on_after(PLACE_TIMEOUT_S):  # a loaded machine may re-elect meanwhile
            while True:
                assigned = await client.post(
                    b.api + "/v1/nodes/assign", json=body, headers=b.admin_headers()
                )
                if assigned.status_code != 503:
                    break
                await trio.sleep(0.2)
        assert assigned.status_code == 200, assigned.text

        def served(model: str) -> Callable[[Views], bool]:
            def check(views: Views) -> bool:
                coverage = (views["a"] or {}).get("coverage", {}).get(model)
                return bool(coverage) and not coverage["gaps"]

            return check

        await wait_for(swarm, [a], served("y"), PLACE_TIMEOUT_S, "B admitted for y")
        entry = ledger_entry(await swarm.status(a), b)
        assert entry is not None and entry["tier"] == "bootstrap" and entry["managed"] is False
        again = await client.post(a.api + "/v1/nodes/assign", json=body, headers=a.admin_headers())
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "already_assigned"
        bad = await client.post(
            a.api + "/v1/nodes/assign", json={**body, "layers": [3, 1]}, headers=a.admin_headers()
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "layers"

        # C joined with --auto-join and w in its store: it took w itself.
        await wait_for(swarm, [a], served("w"), PLACE_TIMEOUT_S, "C auto-joined for w")
        entry = ledger_entry(await swarm.status(a), c)
        assert entry is not None and entry["model"] == "w" and entry["tier"] == "bootstrap"
        response = await ask(client, a, "w")
        assert response.status_code == 200, response.text
    await assert_no_internal_errors(swarm, [a, b, c])


@pytest.mark.slow
async def test_a_spare_node_that_fails_its_doctor_is_passed_over_for_another(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    x = make_tiny_model(tmp_path / "x", layers=8, name="x")
    store_bad, store_good = tmp_path / "store-bad", tmp_path / "store-good"
    good = make_tiny_model(store_good / "y", layers=8, seed=2, name="y")
    bad_copy = store_bad / "y"
    shutil.copytree(good, bad_copy)
    weights, offset, _ = SafetensorsReader(bad_copy).byte_range("model.layers.2.mlp.up_proj.weight")
    data = bytearray(weights.read_bytes())
    data[offset : offset + 32] = bytes(32)
    weights.write_bytes(bytes(data))
    a = swarm.new_node("a", args=["--model", str(x), "--layers", "0:8"])
    bad = swarm.new_node("bad", args=["--models", str(store_bad)])
    await swarm.start_ready(a, timeout=START_TIMEOUT_S)
    await swarm.start_ready(bad, [a.seed], timeout=START_TIMEOUT_S)

    await wait_for(swarm, [a], knows_store(a, bad, "y"), PLACE_TIMEOUT_S, "bad's store known")

    async with httpx.AsyncClient(timeout=60) as client:
        first = await ask(client, a, "y")
        assert first.status_code == 503, first.text

        def marked(views: Views) -> bool:
            return any(d["command"] == "MarkAdmissionFailed" for d in decisions(views))

        await wait_for(swarm, [a, bad], marked, PLACE_TIMEOUT_S, "the failed doctor marked")
        good_node = swarm.new_node("good", args=["--models", str(store_good)])
        await swarm.start_ready(good_node, [a.seed], timeout=START_TIMEOUT_S)
        await ask(client, a, "y")  # demand again: the first may have gone idle

        def served(views: Views) -> bool:
            coverage = (views["a"] or {}).get("coverage", {}).get("y")
            return bool(coverage) and not coverage["gaps"]

        await wait_for(swarm, [a], served, PLACE_TIMEOUT_S, "y served by the good node")
        response = await ask(client, a, "y")
        assert response.status_code == 200, response.text
        assert response.json()["shardmesh"]["route"] == [good_node.node_id]
    view = await swarm.status(a)
    assert view["not_serving"].get(bad.node_id) in ("failed", "no_capability")
    await assert_no_internal_errors(swarm, [a, bad, good_node])


@pytest.mark.slow
async def test_a_dead_serving_node_is_replaced_from_spare_capacity_only(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    x = make_tiny_model(tmp_path / "x", layers=8, name="x")
    store = tmp_path / "store"
    y = make_tiny_model(store / "y", layers=8, seed=2, name="y")
    entry = swarm.new_node("entry", args=["--model", str(x), "--layers", "0:8"])
    pinned = swarm.new_node("pinned", args=["--model", str(y), "--layers", "0:8"])
    spare = swarm.new_node("spare", args=["--models", str(store)])
    await swarm.start_ready(entry, timeout=START_TIMEOUT_S)
    await swarm.start_many([pinned, spare], [entry.seed], timeout=START_TIMEOUT_S)
    await swarm.make_eligible(entry, [pinned, spare], timeout=START_TIMEOUT_S)

    def served_by(node: LocalNode) -> Callable[[Views], bool]:
        def check(views: Views) -> bool:
            coverage = (views["entry"] or {}).get("coverage", {}).get("y")
            return (
                bool(coverage)
                and not coverage["gaps"]
                and not (views["entry"] or {}).get("not_serving", {}).get(node.node_id)
            )

        return check

    await wait_for(swarm, [entry], served_by(pinned), PLACE_TIMEOUT_S, "y served")
    async with httpx.AsyncClient(timeout=60) as client:
        response = await ask(client, entry, "y")  # demand for y
        assert response.status_code == 200, response.text
        assert response.json()["shardmesh"]["route"] == [pinned.node_id]
        await wait_for(
            swarm,
            [entry],
            lambda views: ledger_entry(views["entry"], pinned) is not None,
            PLACE_TIMEOUT_S,
            "the pinned shard in the ledger",
        )
        before = ledger_entry(await swarm.status(entry), pinned)
        # Three voters first, in every node's eyes: with two, losing one
        # leaves no quorum, and a leader holds a new configuration as soon as
        # it appends it, before the others have it.
        await wait_for(
            swarm,
            [entry, pinned, spare],
            lambda views: all(
                len((view or {}).get("raft", {}).get("voters", [])) == 3 for view in views.values()
            ),
            PLACE_TIMEOUT_S,
            "three voters",
        )

        pinned.kill()

        def relocated(views: Views) -> bool:
            return any(
                d["command"] == "Assign" and d["node_id"] == spare.node_id for d in decisions(views)
            )

        await wait_for(swarm, [entry, spare], relocated, PLACE_TIMEOUT_S, "the gap relocated")
        with trio.fail_after(PLACE_TIMEOUT_S):
            while (response := await ask(client, entry, "y")).status_code != 200:
                await trio.sleep(0.2)
        assert response.json()["shardmesh"]["route"] == [spare.node_id]
    views = await swarm.views([entry, spare])
    view = views["entry"]
    decision = next(d for d in decisions(views) if d.get("node_id") == spare.node_id)
    assert decision["code"] in ("relocate", "demand_gap"), decision
    assert ledger_entry(view, spare)["tier"] == "managed"
    assert ledger_entry(view, pinned) == before  # a pinned assignment is never released
    assert ledger_entry(view, entry)["model"] == "x"  # the pinned entry was never a candidate
