"""Chat through real node processes on loopback: admission by the doctor,
OpenAI-compatible completions through a chain of shards, a torch/MLX mixed
chain, a hop killed or stopped in the middle of batched streams (failover,
handover, drain), corrupt and expired nodes kept off routes, and bad
requests answered in OpenAI's error shape.

The reference is transformers' own greedy `generate` on the whole model,
computed in this process from the same model directory.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
TOKENIZERS_LIBRARY = "tokenizers.abi3.so"
"""The Rust extension transformers' tokenizers load (seen in /proc/PID/maps)."""
READY_TIMEOUT_S = 60.0
"""Process start, torch import and the doctor on a loaded 2-core machine."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / MODEL, layers=8, name=MODEL)


def reference_text(
    model_dir: Path, max_tokens: int, messages: Sequence[dict[str, str]] = MESSAGES
) -> tuple[str, int]:
    """transformers' greedy continuation of `messages`: (text, tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
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


# A hop stopped mid-batch (issue 31: "a session leaving mid-batch (failover,
# SIGTERM drain) does not disturb the others"). Three streams run at once
# through one chain, so each hop batches their decode steps (docs/design/
# batching.md); once the hop carrying most of them has run steps of two
# sessions in one forward, it is stopped (SIGKILL, SIGTERM with a replica,
# SIGTERM as the only holder) while every stream is mid-way. Each stream
# must still get exactly transformers' text, whether its session failed
# over, was handed over, or was drained to its end beside the others.


DRAIN_TOKENS = 150
"""Per stream. The stop comes within about ten tokens (measured: 3 to 11
chunks per stream on the 2-core development box), so every stream is
mid-way, and a longer one only adds decode time to the suite."""
PROMPTS: tuple[list[dict[str, str]], ...] = (
    MESSAGES,
    [{"role": "user", "content": "Write a long story about the sea."}],
    [{"role": "user", "content": "What does each node of a swarm hold, and why?"}],
)
"""One stream per prompt, at once. Different prompts (of different lengths)
make every row of a batch its own: a row given another session's cache or
position, in a batch or in a failover's replay, would show in that text."""
STARTED_CHUNKS = 3
"""Chunks every stream has before the stop: all are decoding."""
BATCH_POLL_S = 0.05
"""How often the hops' batching counters are read while waiting for a batch."""


@pytest.fixture(scope="module")
def drain_references(model_dir: Path) -> list[str]:
    """transformers' greedy text of each of PROMPTS, DRAIN_TOKENS long."""
    return [reference_text(model_dir, DRAIN_TOKENS, messages)[0] for messages in PROMPTS]


@dataclass
class Stream:
    """One stream as its client saw it."""

    parts: list[str] = field(default_factory=list)
    finish: str | None = None
    extension: dict[str, Any] = field(default_factory=dict)
    """The final chunk's `shardmesh` extension: reroutes, route, timing."""

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class Stop:
    """The stopped hop, when, and its status read just before the stop."""

    node: LocalNode
    at: float
    sessions: int
    batching: dict[str, Any]


async def _streams_stopping(
    swarm: LocalSwarm,
    entry: LocalNode,
    hops: Sequence[LocalNode],
    stop: Callable[[LocalNode], None],
) -> tuple[list[Stream], Stop]:
    """Stream one greedy chat of DRAIN_TOKENS per prompt of PROMPTS from
    `entry`, all at once, each from its own client address (as different
    users would); once every stream has a few chunks and the one of `hops`
    that carries most of them has batched their steps, `stop` it (SIGKILL,
    SIGTERM). Every stream as its client saw it, in PROMPTS' order, and the
    stop.

    Why wait for a batch: with several sessions live on a hop, every decode
    step goes through its batcher (`hop_server.LIVE_S`), but on the tiny
    model a forward is short beside the rest of a step (messages, Python,
    the other hops), so two sessions' steps share one only when one arrives
    while the other's runs: within the first ten or so steps in every run
    measured, but not always within the first few.
    Waiting for it (rather than hoping) makes every run stop a hop that
    really batched; a stream that ends first fails the test."""
    streams = [Stream() for _ in PROMPTS]
    started = [trio.Event() for _ in PROMPTS]

    async def run(index: int) -> None:
        stream = streams[index]
        body = {
            "model": MODEL,
            "messages": PROMPTS[index],
            "max_tokens": DRAIN_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        transport = httpx.AsyncHTTPTransport(local_address=f"127.0.0.{2 + index}")
        try:
            async with (
                httpx.AsyncClient(transport=transport, timeout=120) as client,
                client.stream("POST", entry.api + "/v1/chat/completions", json=body) as response,
            ):
                assert response.status_code == 200
                async for chunk in sse_chunks(response):
                    assert "error" not in chunk, chunk
                    choice = chunk["choices"][0]
                    stream.parts.append(choice["delta"].get("content") or "")
                    stream.finish = choice["finish_reason"] or stream.finish
                    stream.extension = chunk.get("shardmesh", stream.extension)
                    if len(stream.parts) >= STARTED_CHUNKS:
                        started[index].set()
        finally:
            started[index].set()  # a stream that ended early fails below, not by hanging

    async with trio.open_nursery() as nursery:
        for index in range(len(PROMPTS)):
            nursery.start_soon(run, index)
        for event in started:
            await event.wait()
        while True:
            views = await swarm.views(hops)
            node = max(hops, key=lambda hop: (views[hop.name] or {}).get("sessions", 0))
            view = views[node.name]
            assert view is not None
            if view["hop"]["batching"]["largest"] > 1:
                break
            # Not yet two sessions' steps in one forward there (see above).
            assert not any(s.finish for s in streams), "the streams ended before one batch"
            await trio.sleep(BATCH_POLL_S)
        stop(node)
        stopped = Stop(node, trio.current_time(), view["sessions"], view["hop"]["batching"])
        assert not any(stream.finish for stream in streams), "a stream ended before the stop"
    assert all(stream.finish in ("length", "stop") for stream in streams)
    return streams, stopped


def assert_batched(stop: Stop) -> None:
    """The stopped hop, read just before the stop, was serving several of
    the streams and had run their decode steps in batches (`hop.batching`
    of its status, as benchmarks/concurrency.py reads it), steps of two
    sessions or more in one forward at least once."""
    assert stop.sessions >= 2, stop
    assert stop.batching["batches"] > 0, stop.batching
    assert stop.batching["largest"] > 1, stop.batching


@pytest.mark.slow
async def test_killing_a_hop_mid_batch_moves_its_streams_and_breaks_none(
    swarm: LocalSwarm, model_dir: Path, drain_references: list[str]
) -> None:
    nodes = await start_serving(
        swarm,
        [shard_args(model_dir, s) for s in ("0:3", "3:6", "3:6", "6:8")],
        names=["first", "middle-a", "middle-b", "last"],
    )
    first, middles = nodes[0], nodes[1:3]
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")

    streams, stop = await _streams_stopping(swarm, first, middles, LocalNode.kill)
    assert_batched(stop)
    assert [stream.text for stream in streams] == drain_references
    # Each stream the killed hop carried failed over, any other went on
    # untouched; all finished on the other holder of the span.
    survivor = next(n for n in middles if n is not stop.node)
    moved = [stream for stream in streams if stream.extension["reroutes"] >= 1]
    assert len(moved) == stop.sessions
    assert (await swarm.status(first))["chat"]["reroutes"] >= stop.sessions
    for stream in streams:
        route = stream.extension["route"]
        assert stop.node.node_id not in route and survivor.node_id in route
        # The final chunk names the chain that finished the stream, and its timing.
        assert [hop["node_id"] for hop in stream.extension["timing"]["hops"]] == route
    await assert_no_internal_errors(swarm, [first, survivor, nodes[3]])


@pytest.mark.slow
async def test_sigterm_on_the_only_holder_of_a_span_finishes_every_stream_then_exits_0(
    swarm: LocalSwarm, model_dir: Path, drain_references: list[str]
) -> None:
    nodes = await start_serving(swarm, [shard_args(model_dir, s) for s in ("0:4", "4:8")])
    await wait_for(swarm, nodes, model_ready(MODEL, nodes), READY_TIMEOUT_S, "coverage")
    streams, stop = await _streams_stopping(
        swarm, nodes[0], nodes[1:], lambda node: node.signal(signal.SIGTERM)
    )
    assert_batched(stop)
    assert stop.sessions == len(PROMPTS)
    # Nobody else holds [4, 8): leaving would break the streams, so the node
    # served every one of them to its end, batched as before, with no
    # failover, and only then left.
    assert [stream.text for stream in streams] == drain_references
    assert [stream.extension["reroutes"] for stream in streams] == [0] * len(PROMPTS)
    assert await stop.node.wait_exit(15) == 0
    log = stop.node.log_tail(200)
    assert "Traceback" not in log
    assert f"serving {len(PROMPTS)} open session(s) to their end" in log


@pytest.mark.slow
async def test_sigterm_with_a_second_holder_moves_every_stream_and_exits_at_once(
    swarm: LocalSwarm, model_dir: Path, drain_references: list[str]
) -> None:
    nodes = await start_serving(swarm, [shard_args(model_dir, s) for s in ("0:4", "4:8", "4:8")])

    def two_replicas(views: Views) -> bool:
        for node in nodes:
            coverage = (views.get(node.name) or {}).get("coverage", {}).get(MODEL)
            if coverage is None or coverage["replicas"] != [1, 1, 1, 1, 2, 2, 2, 2]:
                return False
        return True

    await wait_for(swarm, nodes, two_replicas, READY_TIMEOUT_S, "both holders seen by all")
    streams, stop = await _streams_stopping(
        swarm, nodes[0], nodes[1:], lambda node: node.signal(signal.SIGTERM)
    )
    assert_batched(stop)
    # Every stream it carried moved to the other holder (a failover their
    # clients never saw), any other went on untouched, and the stopped node
    # did not wait for the streams to end: it handed its sessions over, all
    # of them at once, and left (a few seconds of leave gossip).
    assert [stream.text for stream in streams] == drain_references
    moved = [stream for stream in streams if stream.extension["reroutes"] >= 1]
    assert len(moved) == stop.sessions
    assert all(stop.node.node_id not in stream.extension["route"] for stream in streams)
    assert await stop.node.wait_exit(10) == 0
    assert trio.current_time() - stop.at < 10
    assert f"handed {stop.sessions} open session(s) over" in stop.node.log_tail(50)
