"""Chat through real node processes on loopback: admission by the doctor,
OpenAI-compatible completions through a chain of shards, a torch/MLX mixed
chain, failover in the middle of a stream, corrupt and expired nodes kept
off routes, and bad requests answered in OpenAI's error shape.

The reference is transformers' own greedy `generate` on the whole model,
computed in this process from the same model directory.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.chat_client import sse_chunks
from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from runtime.inference.chat import PREPARE_POLL_S
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import SafetensorsReader
from tests.swarm_helpers import (
    CONVERGE_TIMEOUT_S,
    START_TIMEOUT_S,
    assert_no_internal_errors,
    wait_for,
)

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the swarm of volunteers."}]
MAX_TOKENS = 40
LONG_TOKENS = 300
"""Long enough that a stream is still running when a hop is killed."""
TOKENIZERS_LIBRARY = "tokenizers.abi3.so"
"""The Rust extension transformers' tokenizers load (seen in /proc/PID/maps)."""
READY_TIMEOUT_S = 60.0
"""Process start, torch import and the doctor on a loaded 2-core machine."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / MODEL, layers=8, name=MODEL)


def reference_text(model_dir: Path, max_tokens: int) -> tuple[str, int]:
    """transformers' greedy continuation of MESSAGES: (text, tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[str, int]:
    return reference_text(model_dir, MAX_TOKENS)


def shard_args(model_dir: Path, span: str, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--layers", span, *extra]


async def start_serving(
    swarm: LocalSwarm, specs: Sequence[Sequence[str]], names: Sequence[str] | None = None
) -> list[LocalNode]:
    """Start one node per arg list (the first founds the swarm)."""
    nodes = [swarm.new_node(names[i] if names else None, args=args) for i, args in enumerate(specs)]
    await swarm.start_ready(nodes[0], timeout=START_TIMEOUT_S)
    await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=START_TIMEOUT_S)
    return nodes


def model_ready(name: str, observers: Sequence[LocalNode]) -> Callable[[Views], bool]:
    def check(views: Views) -> bool:
        for node in observers:
            coverage = (views.get(node.name) or {}).get("coverage", {}).get(name)
            if coverage is None or coverage["gaps"] or coverage["layers"] != 8:
                return False
        return True

    return check


async def chat(client: httpx.AsyncClient, node: LocalNode, **overrides: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    body.update(overrides)
    return await client.post(node.api + "/v1/chat/completions", json=body)


async def sessions(swarm: LocalSwarm, nodes: Sequence[LocalNode]) -> dict[str, int]:
    views = await swarm.views(nodes)
    return {name: (view or {}).get("sessions", -1) for name, view in views.items()}


@pytest.mark.slow
async def test_a_three_node_chain_answers_like_transformers_through_any_node(
    swarm: LocalSwarm, model_dir: Path, reference: tuple[str, int]
) -> None:
    nodes = await start_serving(swarm, [shard_args(model_dir, s) for s in ("0:3", "3:6", "6:8")])
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")
    text, count = reference
    async with httpx.AsyncClient(timeout=60) as client:
        for node in nodes:
            response = await chat(client, node)
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["choices"][0]["message"]["content"] == text, node.name
            assert body["choices"][0]["finish_reason"] == (
                "length" if count == MAX_TOKENS else "stop"
            )
            assert body["usage"]["completion_tokens"] == count
            assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + count
            route = body["shardmesh"]["route"]
            assert len(route) == 3
            # Where the time went: every hop of the route reported its compute,
            # and a chain's steps run one hop after another, so the entry saw
            # each token take at least the hops' compute put together.
            timing = body["shardmesh"]["timing"]
            assert [hop["node_id"] for hop in timing["hops"]] == route
            assert all(hop["prefill_ms"] > 0 for hop in timing["hops"])
            per_step = [hop["decode_ms_per_step"] for hop in timing["hops"]]
            assert all(ms > 0 for ms in per_step)
            assert timing["ttft_ms"] > 0 and 0 < sum(per_step) <= timing["decode_ms_per_token"]
            assert timing["decode_ms_beyond_compute"] >= 0

        models = (await client.get(nodes[0].api + "/v1/models")).json()["data"]
        assert [(m["id"], m["status"]) for m in models] == [(MODEL, "ready")]

    # The official OpenAI client, streaming.
    def stream_with_openai() -> str:
        import openai

        client = openai.OpenAI(base_url=nodes[2].api + "/v1", api_key="unused")
        parts = []
        for chunk in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    assert await trio.to_thread.run_sync(stream_with_openai) == text

    views = await swarm.views(nodes)
    for node in nodes:
        view = views[node.name]
        assert view["admission"]["state"] == "admitted"
        me = next(m for m in view["members"] if m["self"])
        assert me["record"]["capability"]["result"] == "admitted"
        assert me["record"]["assignment"]["tier"] == "operator"
        # Four requests, each a prefill and count - 1 decode steps on every hop.
        assert view["hop"]["prefill_steps"] == 4
        assert view["hop"]["decode_steps"] == 4 * (count - 1)
    # The same counts, as Prometheus scrapes them from the middle hop.
    async with httpx.AsyncClient(timeout=10) as client:
        scraped = (await client.get(nodes[1].api + "/metrics")).text
    assert f'shardmesh_hop_steps_total{{phase="decode"}} {4 * (count - 1)}\n' in scraped
    assert 'shardmesh_admission_state{state="admitted"} 1.0\n' in scraped
    # Every session was closed when its request ended. The entry sends each
    # hop its close as the request ends, so a hop may count it a moment after
    # the client has the answer (the idle reaper needs 60 s: not it, here).
    await wait_for(
        swarm,
        nodes,
        lambda views: all((view or {}).get("sessions") == 0 for view in views.values()),
        CONVERGE_TIMEOUT_S,
        "every hop's sessions closed",
    )
    await assert_no_internal_errors(swarm, nodes)


@pytest.mark.slow
async def test_a_chain_mixing_torch_and_mlx_hops_gives_the_same_tokens(
    swarm: LocalSwarm, model_dir: Path, reference: tuple[str, int]
) -> None:
    nodes = await start_serving(
        swarm,
        [
            shard_args(model_dir, "0:3", "--backend", "torch"),
            shard_args(model_dir, "3:6", "--backend", "mlx"),
            shard_args(model_dir, "6:8", "--backend", "torch"),
        ],
    )
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")
    views = await swarm.views(nodes)
    assert views[nodes[1].name]["admission"]["doctor"]["backend"] == "mlx"
    async with httpx.AsyncClient(timeout=60) as client:
        response = await chat(client, nodes[0])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == reference[0]


@pytest.mark.slow
async def test_killing_a_hop_mid_stream_does_not_break_the_stream(
    swarm: LocalSwarm, model_dir: Path
) -> None:
    expected, _ = await trio.to_thread.run_sync(reference_text, model_dir, LONG_TOKENS)
    nodes = await start_serving(
        swarm,
        [shard_args(model_dir, s) for s in ("0:3", "3:6", "3:6", "6:8")],
        names=["first", "middle-a", "middle-b", "last"],
    )
    first, middles = nodes[0], nodes[1:3]
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")

    text, extension, killed, _ = await _stream_stopping(
        swarm, first, middles, LONG_TOKENS, LocalNode.kill
    )
    assert text == expected
    assert (await swarm.status(first))["chat"]["reroutes"] >= 1
    survivor = next(n for n in middles if n is not killed)
    # The final chunk names the chain that finished the stream, and its timing.
    assert extension["reroutes"] >= 1
    assert killed.node_id not in extension["route"] and survivor.node_id in extension["route"]
    assert [hop["node_id"] for hop in extension["timing"]["hops"]] == extension["route"]
    await assert_no_internal_errors(swarm, [first, survivor, nodes[3]])


@pytest.mark.slow
async def test_a_corrupt_node_is_refused_and_never_routed(
    swarm: LocalSwarm, model_dir: Path, reference: tuple[str, int], tmp_path: Path
) -> None:
    # A copy whose weights differ from what its (unchanged) manifest says:
    # it would compute wrong activations if anyone routed to it.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model_dir, corrupt)
    name = "model.layers.4.mlp.down_proj.weight"
    weights, offset, _ = SafetensorsReader(corrupt).byte_range(name)
    data = bytearray(weights.read_bytes())
    data[offset : offset + 64] = bytes(64)
    weights.write_bytes(bytes(data))

    nodes = await start_serving(
        swarm,
        [
            shard_args(model_dir, "0:3"),
            shard_args(corrupt, "3:6"),
            shard_args(model_dir, "3:6"),
            shard_args(model_dir, "6:8"),
        ],
        names=["first", "corrupt", "good", "last"],
    )
    bad = nodes[1]
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")

    await wait_for(
        swarm,
        [bad],
        lambda views: (views[bad.name] or {}).get("admission", {}).get("state") == "failed",
        READY_TIMEOUT_S,
        "the corrupt node's doctor",
    )
    view = await swarm.status(bad)
    doctor = view["admission"]["doctor"]
    assert doctor["failed_check"] == "tensors" and doctor["reason"] == "digest_mismatch"
    assert name in doctor["message"]
    # The failed report reaches the others by gossip, a little after the node
    # itself holds it; until then they know no report of it at all.
    await wait_for(
        swarm,
        [nodes[0]],
        lambda views: views["first"]["not_serving"].get(bad.node_id) == "failed",
        CONVERGE_TIMEOUT_S,
        "the failed report reaching first",
    )

    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(4):
            response = await chat(client, nodes[0])
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == reference[0]
            assert bad.node_id not in response.json()["shardmesh"]["route"]
    drops = (await swarm.status(bad))["drops"]
    assert not any(reason.startswith("engine.") for reason in drops), drops


@pytest.mark.slow
async def test_an_expired_capability_drops_out_until_refreshed(
    swarm: LocalSwarm, model_dir: Path
) -> None:
    # Valid for 2 s, refreshed every 4 s: out of coverage half the time.
    (node,) = await start_serving(
        swarm, [shard_args(model_dir, "0:8", "--capability-ttl", "2", "--capability-refresh", "4")]
    )

    def serving(views: Views) -> bool:
        return not (views[node.name]["coverage"].get(MODEL) or {"gaps": [1]})["gaps"]

    def expired(views: Views) -> bool:
        return views[node.name]["not_serving"].get(node.node_id) == "expired"

    await wait_for(swarm, [node], serving, READY_TIMEOUT_S, "admitted")
    await wait_for(swarm, [node], expired, 10.0, "expired")
    async with httpx.AsyncClient(timeout=30) as client:
        response = await chat(client, node)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "model_loading"
    await wait_for(swarm, [node], serving, 10.0, "refreshed")


@pytest.mark.slow
async def test_bad_requests_get_openai_errors_and_the_node_keeps_serving(
    swarm: LocalSwarm, model_dir: Path, tmp_path: Path
) -> None:
    other = make_tiny_model(tmp_path / "other", layers=8, seed=3, name="other")
    nodes = await start_serving(swarm, [shard_args(model_dir, "0:8"), shard_args(other, "0:3")])
    node = nodes[0]
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")
    await wait_for(
        swarm,
        [node],
        lambda views: "other" in views[node.name]["coverage"],
        READY_TIMEOUT_S,
        "the partial model",
    )
    url = node.api + "/v1/chat/completions"
    good = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    cases = [
        ({**good, "model": "no-such-model"}, 404, "model"),
        ({**good, "max_tokens": -1}, 400, "max_tokens"),
        ({**good, "temperature": 3.5}, 400, "temperature"),
        ({**good, "messages": []}, 400, "messages"),
        ({**good, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ({**good, "messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    ]
    async with httpx.AsyncClient(timeout=60) as client:
        for body, status, param in cases:
            response = await client.post(url, json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"], error
        malformed = await client.post(
            url, content=b"{not json", headers={"content-type": "application/json"}
        )
        assert malformed.status_code == 400
        not_json = await client.post(url, content=b"{}", headers={"content-type": "text/plain"})
        assert not_json.status_code == 415  # no cross-site "simple" request reaches a route
        assert "JSON" in malformed.json()["error"]["message"]
        loading = await client.post(url, json={**good, "model": "other"})
        assert loading.status_code == 503
        assert loading.headers["retry-after"]
        error = loading.json()["error"]
        assert error["type"] == "model_loading"
        assert error["coverage"]["covered"] == [[0, 3]] and error["coverage"]["gaps"] == [[3, 8]]
        still = await client.post(url, json=good)
        assert still.status_code == 200, still.text
        await full_chain_answers_429(swarm, node, client, good)
    await assert_no_internal_errors(swarm, nodes)


HELD_STREAMS = 8
"""A hop gives one entry half its 16 sessions (`MAX_SESSION_SHARE`); the
streams come from two client addresses, four each (the client quota)."""


async def full_chain_answers_429(
    swarm: LocalSwarm, node: LocalNode, client: httpx.AsyncClient, good: dict[str, Any]
) -> None:
    """While streams hold every session the only chain gives this entry, one
    more chat is a 429 that says to come back, not a lost generation."""
    url = node.api + "/v1/chat/completions"
    long = {**good, "max_tokens": 1500, "stream": True}

    async def hold(address: str) -> None:
        transport = httpx.AsyncHTTPTransport(local_address=address)
        async with (
            httpx.AsyncClient(transport=transport, timeout=120) as own,
            own.stream("POST", url, json=long) as streamed,
        ):
            async for _ in streamed.aiter_lines():
                pass

    async with trio.open_nursery() as nursery:
        for index in range(HELD_STREAMS):
            nursery.start_soon(hold, f"127.0.0.{2 + index // 4}")
        await wait_for(
            swarm,
            [node],
            lambda views: views[node.name]["sessions"] >= HELD_STREAMS,
            READY_TIMEOUT_S,
            "every session held",
        )
        refused = await client.post(url, json=good)
        nursery.cancel_scope.cancel()
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["reason"]) == (
        "requests",
        "rate_limit_exceeded",
        "chains_full",
    )


def maps_library(node: LocalNode, library: str) -> bool:
    """Whether the node's process has `library` (a shared object) mapped."""
    return library in Path(f"/proc/{node.process.pid}/maps").read_text()


@pytest.mark.slow
async def test_a_light_entry_loads_the_tokenizer_library_once_the_swarm_has_a_model(
    swarm: LocalSwarm, model_dir: Path
) -> None:
    light = swarm.new_node("light", forked=False)  # its own imports are what is measured
    await swarm.start_ready(light, timeout=START_TIMEOUT_S)
    # With nothing in the swarm to chat with, it does not pay for the library.
    await trio.sleep(2 * PREPARE_POLL_S)
    assert not maps_library(light, TOKENIZERS_LIBRARY)

    serving = swarm.new_node("serving", args=shard_args(model_dir, "0:8"))
    await swarm.start_ready(serving, [light.seed], timeout=START_TIMEOUT_S)
    await wait_for(swarm, [light], model_ready(MODEL, [light]), READY_TIMEOUT_S, "coverage")
    # Before any request: the first chat through it will not wait for the import.
    with trio.fail_after(READY_TIMEOUT_S):
        while not maps_library(light, TOKENIZERS_LIBRARY):
            await trio.sleep(0.2)
    async with httpx.AsyncClient(timeout=60) as client:
        response = await chat(client, light)
    assert response.status_code == 200, response.text
    assert response.json()["shardmesh"]["route"] == [serving.node_id]


DRAIN_TOKENS = 400
"""The acceptance's stream: long enough to be mid-way when a hop is stopped."""


async def _stream_stopping(
    swarm: LocalSwarm,
    entry: LocalNode,
    hops: Sequence[LocalNode],
    tokens: int,
    stop: Callable[[LocalNode], None],
) -> tuple[str, dict[str, Any], LocalNode, float]:
    """Stream `tokens` greedily from `entry`; after a few tokens `stop`
    whichever of `hops` this stream runs through (SIGKILL, SIGTERM). The
    text, the final chunk's `shardmesh` extension (reroutes, route,
    timing), the stopped node, and when it was stopped."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    parts: list[str] = []
    stopped: LocalNode | None = None
    stopped_at = 0.0
    finish = None
    extension: dict[str, Any] = {}
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", entry.api + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for chunk in sse_chunks(response):
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            parts.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
            extension = chunk.get("shardmesh", extension)  # on the final chunk
            if stopped is None and len(parts) > 3:
                busy = await sessions(swarm, hops)
                stopped = next(n for n in hops if busy[n.name] > 0)
                stop(stopped)
                stopped_at = trio.current_time()
    assert stopped is not None
    assert finish in ("length", "stop")
    return "".join(parts), extension, stopped, stopped_at


@pytest.mark.slow
async def test_sigterm_on_the_only_holder_of_a_span_finishes_the_stream_then_exits_0(
    swarm: LocalSwarm, model_dir: Path
) -> None:
    expected, _ = await trio.to_thread.run_sync(reference_text, model_dir, DRAIN_TOKENS)
    nodes = await start_serving(swarm, [shard_args(model_dir, s) for s in ("0:4", "4:8")])
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")
    text, extension, stopped, _ = await _stream_stopping(
        swarm, nodes[0], nodes[1:], DRAIN_TOKENS, lambda node: node.signal(signal.SIGTERM)
    )
    # Nobody else holds [4, 8): leaving would break the stream, so the node
    # served it to its end, with no failover, and only then left.
    assert text == expected
    assert extension["reroutes"] == 0
    assert await stopped.wait_exit(15) == 0
    assert "Traceback" not in stopped.log_tail(200)


@pytest.mark.slow
async def test_sigterm_with_a_second_holder_moves_the_stream_and_exits_at_once(
    swarm: LocalSwarm, model_dir: Path
) -> None:
    expected, _ = await trio.to_thread.run_sync(reference_text, model_dir, DRAIN_TOKENS)
    nodes = await start_serving(swarm, [shard_args(model_dir, s) for s in ("0:4", "4:8", "4:8")])

    def two_replicas(views: Views) -> bool:
        for node in nodes:
            coverage = (views.get(node.name) or {}).get("coverage", {}).get(MODEL)
            if coverage is None or coverage["replicas"] != [1, 1, 1, 1, 2, 2, 2, 2]:
                return False
        return True

    await wait_for(swarm, nodes, two_replicas, READY_TIMEOUT_S, "both holders seen by all")
    text, extension, stopped, signalled = await _stream_stopping(
        swarm, nodes[0], nodes[1:], DRAIN_TOKENS, lambda node: node.signal(signal.SIGTERM)
    )
    # The stream moved to the other holder (a failover the client never
    # saw), and the stopped node did not wait for the stream to end: it
    # handed its session over and left (a few seconds of leave gossip).
    assert text == expected
    assert extension["reroutes"] >= 1 and stopped.node_id not in extension["route"]
    assert await stopped.wait_exit(10) == 0
    assert trio.current_time() - signalled < 10
    assert "handed 1 open session(s) over" in stopped.log_tail(50)
