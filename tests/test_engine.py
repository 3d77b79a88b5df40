"""The inference engine over real ZeroMQ planes, in one trio process.

Every "node" here is a real pair of planes on 127.0.0.1 with its own
`Engine` (and `HopServer` when it holds a shard); the shards are real torch
(and MLX) shards of the 8-layer tiny model, split [0,3), [3,6), [6,8). The
properties that make the swarm one model: greedy output through the chain is
token-for-token what transformers' own `generate` produces on the whole
model, whatever the backends; sessions do not interfere; a hop that dies in
the middle of a stream is routed around and the stream continues with
exactly the tokens an uninterrupted run gives; and no input from the network
can crash a hop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import trio

from mesh.transport import open_planes
from mesh.wire import decode_tensor
from runtime.inference.chain import ChainTiming, Failure, Hop, Pipeline, PipelineError, Timeouts
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import HopServer
from runtime.inference.protocol import encode_message, new_session_id
from runtime.model.backends import load_shard
from runtime.model.backends.base import ShardBackend, ShardSpec
from runtime.model.sampling import SamplingParams

pytest_plugins = ["tests.runtime_fixtures"]

MODEL = "tiny-qwen3"
SPANS = ((0, 3), (3, 6), (6, 8))
PROMPT = (5, 40, 99, 250, 7, 12, 301)
OTHER_PROMPT = (17, 3, 260, 88)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=NEW_TOKENS)
SEED = 1234
LOOPBACK = "tcp://127.0.0.1:0"
# Tight enough that a dead hop is noticed in a fraction of a second, loose
# enough for a loaded 2-core CI box (a tiny-model step takes ~1-3 ms).
FAST = Timeouts(open_s=2.0, prefill_base_s=2.0, decode_step_s=0.5)
# How long to wait for asynchronous effects (a close reaching a hop).
SETTLE_S = 5.0


# --- fixtures -------------------------------------------------------------------


def _load(model_dir: Path, span: tuple[int, int], backend: str) -> ShardBackend:
    shard = load_shard(ShardSpec(model_dir, span[0], span[1], "fp32"), backend)
    # MLX must run its first op on the main thread: when its first op runs on a
    # worker thread, the process aborts at exit ("terminate called without an
    # active exception", MLX CPU, observed with mlx 0.29). Hops run forwards
    # in worker threads, so warm each shard up here.
    inputs = np.zeros(1, np.int64) if shard.is_first else np.zeros((1, shard.hidden_size), "f4")
    shard.forward(inputs, np.zeros(1, np.int64), shard.new_cache())
    return shard


@pytest.fixture(scope="module")
def torch_shards(qwen3_dir: Path) -> dict[tuple[int, int], ShardBackend]:
    return {span: _load(qwen3_dir, span, "torch") for span in SPANS}


@pytest.fixture(scope="module")
def reference(qwen3_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy `generate` on the full model, per prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens
    out = {}
    with torch.no_grad():
        for prompt in (PROMPT, OTHER_PROMPT):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out[prompt] = ids[0, len(prompt) :].tolist()
    return out


@dataclass
class Node:
    """A running test node: its engine, drops, and a way to kill it."""

    node_id: str
    engine: Engine
    drops: Counter[str]
    address: str
    scope: trio.CancelScope

    @property
    def hop(self) -> HopServer:
        assert self.engine.hop_server is not None
        return self.engine.hop_server

    def as_hop(self) -> Hop:
        spec = self.hop.shard.spec
        return Hop(self.node_id, self.address, (spec.start, spec.end))

    def stop(self) -> None:
        """Like a crashed process: the planes close, nothing more is said."""
        self.scope.cancel()


async def _serve_node(
    node_id: str,
    shard: ShardBackend | None,
    limits: dict[str, Any],
    *,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.CancelScope() as scope:
        drops: Counter[str] = Counter()
        async with open_planes(LOOPBACK, LOOPBACK, drops=drops) as (_control, data):
            hop = None
            if shard is not None:
                hop = HopServer(data, shard, model=MODEL, drops=drops, **limits)
            engine = Engine(data, drops=drops, hop_server=hop)
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                task_status.started(Node(node_id, engine, drops, data.address, scope))


async def start_node(
    nursery: trio.Nursery, node_id: str, shard: ShardBackend | None = None, **limits: Any
) -> Node:
    node: Node = await nursery.start(_serve_node, node_id, shard, limits)
    return node


async def start_chain(
    nursery: trio.Nursery, shards: Sequence[ShardBackend], **limits: Any
) -> tuple[Pipeline, list[Node]]:
    entry = await start_node(nursery, "entry")
    hops = [await start_node(nursery, f"hop{i}", s, **limits) for i, s in enumerate(shards)]
    return entry.engine.pipeline, hops


async def collect(
    pipeline: Pipeline,
    chain: Sequence[Hop],
    prompt: Sequence[int] = PROMPT,
    params: SamplingParams = GREEDY,
    **kwargs: Any,
) -> list[int]:
    kwargs.setdefault("timeouts", FAST)
    stream = pipeline.generate(MODEL, chain, prompt, params, seed=SEED, **kwargs)
    async with aclosing(stream) as tokens:
        return [token async for token in tokens]


async def settle(nodes: Sequence[Node]) -> None:
    """Wait until every hop has closed all its sessions."""
    with trio.fail_after(SETTLE_S):
        while any(node.hop.sessions for node in nodes):
            await trio.sleep(0.01)


# --- generation -------------------------------------------------------------------


async def test_greedy_three_hops_equals_transformers_generate(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        chain = [node.as_hop() for node in hops]
        timing = ChainTiming()
        assert await collect(pipeline, chain, timing=timing) == reference[PROMPT]
        await settle(hops)  # closing released the session on every hop
        # Every hop computed the prompt once and each later token once...
        assert timing.nodes == ["hop0", "hop1", "hop2"]
        assert timing.decode_steps == NEW_TOKENS - 1
        for node, prefill_us, decode_us in zip(
            hops, timing.prefill_us, timing.decode_us, strict=True
        ):
            stats = node.engine.hop_stats
            assert stats is not None
            assert (stats["prefill_steps"], stats["prefill_tokens"]) == (1, len(PROMPT))
            assert stats["decode_steps"] == NEW_TOKENS - 1
            assert stats["decode_compute_s"] > 0 and stats["prefill_compute_s"] > 0
            # ...and the times its tokens carried back are the hop's own
            # (each step's rounded to the microsecond).
            assert abs(prefill_us - stats["prefill_compute_s"] * 1e6) <= 1
            assert abs(decode_us - stats["decode_compute_s"] * 1e6) <= NEW_TOKENS
        nursery.cancel_scope.cancel()


async def test_mixed_torch_and_mlx_chain(
    qwen3_dir: Path,
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    middle = _load(qwen3_dir, (3, 6), "mlx")  # `make test` installs MLX: never skipped
    async with trio.open_nursery() as nursery:
        shards = [torch_shards[(0, 3)], middle, torch_shards[(6, 8)]]
        pipeline, hops = await start_chain(nursery, shards)
        assert await collect(pipeline, [node.as_hop() for node in hops]) == reference[PROMPT]
        nursery.cancel_scope.cancel()


async def test_concurrent_sessions_do_not_interfere(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    results: dict[tuple[int, ...], list[int]] = {}

    async def run(pipeline: Pipeline, chain: list[Hop], prompt: tuple[int, ...]) -> None:
        results[prompt] = await collect(pipeline, chain, prompt)

    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        chain = [node.as_hop() for node in hops]
        async with trio.open_nursery() as both:
            for prompt in (PROMPT, OTHER_PROMPT, PROMPT):
                both.start_soon(run, pipeline, chain, prompt)
        assert results == {p: reference[p] for p in (PROMPT, OTHER_PROMPT)}
        await settle(hops)
        nursery.cancel_scope.cancel()


async def test_consumer_stopping_early_closes_every_session(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        chain = [node.as_hop() for node in hops]
        stream = pipeline.generate(MODEL, chain, PROMPT, GREEDY, seed=SEED, timeouts=FAST)
        got = []
        async with aclosing(stream) as tokens:
            async for token in tokens:
                got.append(token)
                if len(got) == 3:
                    assert [node.hop.sessions for node in hops] == [1, 1, 1]
                    break
        assert got == reference[PROMPT][:3]
        await settle(hops)
        # The step after the last token taken was already sent when the
        # consumer stopped (the chain computes while the caller streams):
        # the first hop, which hears it before the close, computed it.
        first = hops[0].engine.hop_stats
        assert first is not None and first["decode_steps"] == 3
        nursery.cancel_scope.cancel()


async def test_steps_behind_a_busy_shard_queue_and_run_in_order(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    """A decode step normally runs straight from the receive loop; while the
    shard is busy (here: a capability re-check holding it) steps queue
    behind it, and every step still runs exactly once, in order."""
    shard = torch_shards[SPANS[0]]
    decode_tokens = (11, 250, 3, 42)
    cache = shard.new_cache()
    expected = [shard.forward(np.array(PROMPT), np.arange(len(PROMPT)), cache)]
    for i, token in enumerate(decode_tokens):
        position = np.array([len(PROMPT) + i])
        expected.append(shard.forward(np.array([token]), position, cache))

    async with trio.open_nursery() as nursery:
        hop = await start_node(nursery, "hop", shard)
        drops: Counter[str] = Counter()
        async with open_planes(LOOPBACK, LOOPBACK, drops=drops) as (_control, peer):

            async def activations() -> np.ndarray:
                with trio.fail_after(SETTLE_S):
                    header, dtype, shape, raw = decode_tensor(await peer.receive())
                assert header["op"] == "forward", header
                return np.frombuffer(raw, dtype=dtype).reshape(shape)

            session = new_session_id()
            peer.send(
                hop.address,
                encode_message(
                    {
                        "op": "open",
                        "session": session,
                        "model": MODEL,
                        "layers": list(SPANS[0]),
                        "reply": peer.address,
                        "budget": 64,
                        "next": peer.address,  # this test plays the next hop too
                        "next_session": new_session_id(),
                        "sampling": None,
                        "seed": 0,
                    }
                ),
            )

            def step(index: int, pos: int, tokens: Sequence[int]) -> list[Any]:
                header = {"op": "forward", "session": session, "step": index, "pos": pos}
                return encode_message(header, np.array(tokens, np.int64))

            with trio.fail_after(SETTLE_S):
                assert decode_tensor(await peer.receive())[0]["op"] == "opened"
            peer.send(hop.address, step(0, 0, PROMPT))
            got = [await activations()]

            release = trio.Event()
            holding = trio.Event()

            def hold_shard() -> None:
                trio.from_thread.run_sync(holding.set)
                trio.from_thread.run(release.wait)

            nursery.start_soon(hop.hop.on_shard, hold_shard)
            await holding.wait()
            for i, token in enumerate(decode_tokens[:3]):
                peer.send(hop.address, step(i + 1, len(PROMPT) + i, [token]))
            await trio.sleep(0.2)  # all three arrive while the shard is held
            release.set()
            got += [await activations() for _ in range(3)]
            # The shard is free again: the next step runs from the receive loop.
            peer.send(hop.address, step(4, len(PROMPT) + 3, decode_tokens[3:]))
            got.append(await activations())
        for want, have in zip(expected, got, strict=True):
            np.testing.assert_array_equal(have, want)
        assert not any(k.startswith("engine.") for k in hop.drops)
        nursery.cancel_scope.cancel()


# --- limits -----------------------------------------------------------------------


async def test_busy_when_the_session_limit_is_reached(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(
            nursery, [torch_shards[s] for s in SPANS], max_sessions=1
        )
        chain = [node.as_hop() for node in hops]
        first = pipeline.generate(MODEL, chain, PROMPT, GREEDY, seed=SEED, timeouts=FAST)
        async with aclosing(first) as tokens:
            assert await anext(tokens) == reference[PROMPT][0]  # holds one session per hop
            seen: list[Failure] = []

            async def give_up(failure: Failure) -> None:
                seen.append(failure)

            with trio.fail_after(1.0), pytest.raises(PipelineError, match="busy"):
                await collect(pipeline, chain, OTHER_PROMPT, reroute=give_up)
            # Failing fast: the first busy hop ends the attempt, and is the suspect.
            names = {node.node_id for node in hops}
            assert len(seen) == 1 and seen[0].nodes == names and seen[0].step == 0
            assert len(seen[0].suspects) == 1 and seen[0].suspects <= names
            # The first stream is unaffected.
            rest = [token async for token in tokens]
        assert rest == reference[PROMPT][1:]
        await settle(hops)
        nursery.cancel_scope.cancel()


async def test_idle_sessions_are_reaped(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    idle_s = 0.2
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(
            nursery, [torch_shards[s] for s in SPANS], idle_timeout_s=idle_s
        )
        chain = [node.as_hop() for node in hops]
        stream = pipeline.generate(MODEL, chain, PROMPT, GREEDY, seed=SEED, timeouts=FAST)
        async with aclosing(stream) as tokens:
            await anext(tokens)
            assert [node.hop.sessions for node in hops] == [1, 1, 1]
            await trio.sleep(idle_s * 2)  # the consumer stalls; nothing is sent
            assert [node.hop.sessions for node in hops] == [0, 0, 0]
            assert all(node.hop.stats.reaped == 1 for node in hops)
            # The step sent ahead before the stall was computed before the
            # reaping, so its token still arrives; the step after it finds
            # no session and fails.
            assert await anext(tokens) == reference[PROMPT][1]
            with pytest.raises(PipelineError, match="no token"):
                await anext(tokens)
        assert hops[0].drops["engine.unknown_session"] == 1
        nursery.cancel_scope.cancel()


async def test_budget_is_enforced(torch_shards: dict[tuple[int, int], ShardBackend]) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(
            nursery, [torch_shards[s] for s in SPANS], max_budget=len(PROMPT) + 4
        )
        chain = [node.as_hop() for node in hops]
        with pytest.raises(PipelineError, match="budget"):
            await collect(pipeline, chain)  # asks for len(PROMPT) + 24 positions
        assert len(await collect(pipeline, chain, context_window=len(PROMPT) + 4)) == 4
        unbounded = SamplingParams(temperature=0.0)
        got = await collect(pipeline, chain, params=unbounded, context_window=len(PROMPT) + 3)
        assert len(got) == 3
        with pytest.raises(ValueError, match="context window"):
            await collect(pipeline, chain, params=unbounded)
        with pytest.raises(ValueError, match="fills the context window"):
            await collect(pipeline, chain, context_window=len(PROMPT))
        nursery.cancel_scope.cancel()


# --- hostile input --------------------------------------------------------------------


def _raw(header: dict[str, Any], array: np.ndarray | None = None) -> list[Any]:
    return encode_message(header, array)


async def test_malformed_data_plane_input_is_counted_and_survived(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        first = hops[0]
        drops: Counter[str] = Counter()
        async with open_planes(LOOPBACK, LOOPBACK, drops=drops) as (_control, peer):

            async def reply() -> dict[str, Any]:
                with trio.fail_after(SETTLE_S):
                    header, *_ = decode_tensor(await peer.receive())
                return header

            to = first.address
            ghost = {"op": "forward", "session": new_session_id(), "step": 0, "pos": 0}
            header_frame, _ = _raw(ghost, np.array([1], np.int64))
            peer.send(to, [b"\xff\x00garbage"])  # not a tensor frame pair
            peer.send(to, [header_frame, b"\x00" * 3])  # raw frame does not match the shape
            peer.send(to, [b"\x1c", b""])  # malformed CBOR header
            peer.send(to, _raw({"op": "explode"}))
            peer.send(to, _raw(ghost, np.array([1], np.int64)))
            peer.send(to, _raw({"op": "forward", "step": 0, "pos": 0}))  # no session
            peer.send(to, _raw({"op": "close", "session": "not-hex"}))
            peer.send(to, _raw({"op": "open", "session": new_session_id(), "reply": 7}))

            # An open with a reply address is answered, even when refused.
            wrong = new_session_id()
            bad_open = {
                "op": "open",
                "session": wrong,
                "model": "some-other-model",
                "layers": [0, 3],
                "reply": peer.address,
                "budget": 64,
                "next": hops[1].address,
                "next_session": new_session_id(),
                "sampling": None,
                "seed": 0,
            }
            peer.send(to, _raw(bad_open))
            answer = await reply()
            assert answer["op"] == "error" and answer["session"] == wrong
            assert answer["reason"].startswith("wrong_shard")

            # A real session, then steps that break its rules: each is answered
            # with an error, which also ends the session.
            async def open_session() -> str:
                session = new_session_id()
                peer.send(to, _raw({**bad_open, "session": session, "model": MODEL}))
                assert await reply() == {"op": "opened", "session": session}
                return session

            one = np.array([1], np.int64)
            for inputs, pos, extra, reason in (
                (np.zeros((1, 64), np.float32), 0, {}, "bad_payload"),  # hidden into hop 0
                (np.array([1, 2], np.int64), 5, {}, "bad_position"),
                (np.arange(65, dtype=np.int64), 0, {}, "budget_exceeded"),
                (np.array([100_000], np.int64), 0, {}, "shard_failed"),  # id out of range
                (one, 0, {"compute_us": [-5]}, "bad_field"),
                (one, 0, {"compute_us": list(range(257))}, "bad_field"),  # past MAX_CHAIN_HOPS
            ):
                session = await open_session()
                step = {"op": "forward", "session": session, "step": 0, "pos": pos, **extra}
                peer.send(to, _raw(step, inputs))
                answer = await reply()
                assert answer["op"] == "error" and answer["session"] == session
                assert answer["step"] == 0 and answer["reason"].startswith(reason)

        # The garbage flood of a hostile peer...
        with trio.fail_after(SETTLE_S):
            while first.hop.sessions:
                await trio.sleep(0.01)
        expected = {
            "engine.bad_tensor": 2,
            "engine.malformed_cbor": 1,
            "engine.unknown_op": 1,
            "engine.unknown_session": 1,
            "engine.bad_field": 5,
            "engine.wrong_shard": 1,
            "engine.bad_payload": 1,
            "engine.bad_position": 1,
            "engine.budget_exceeded": 1,
            "engine.shard_failed": 1,
        }
        assert {k: first.drops[k] for k in expected} == expected
        # ...left the hop serving.
        chain = [node.as_hop() for node in hops]
        assert await collect(pipeline, chain) == reference[PROMPT]
        nursery.cancel_scope.cancel()


# --- failover ---------------------------------------------------------------------


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_failover_mid_stream_continues_with_identical_tokens(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
    params: SamplingParams,
) -> None:
    kill_after = 7
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        a = await start_node(nursery, "a", torch_shards[(0, 3)])
        b1 = await start_node(nursery, "b1", torch_shards[(3, 6)])
        b2 = await start_node(nursery, "b2", torch_shards[(3, 6)])
        c = await start_node(nursery, "c", torch_shards[(6, 8)])
        replicas = [[a], [b1, b2], [c]]
        dead: set[str] = set()  # what membership would report
        failures: list[Failure] = []

        async def reroute(failure: Failure) -> list[Hop] | None:
            failures.append(failure)
            chain = []
            for span in replicas:
                alive = [node for node in span if node.node_id not in dead]
                if not alive:
                    return None
                chain.append(alive[0].as_hop())
            return chain

        # The uninterrupted run, on the chain the stream will end up on.
        pipeline = entry.engine.pipeline
        expected = await collect(pipeline, [a.as_hop(), b2.as_hop(), c.as_hop()], params=params)
        if params is GREEDY:
            assert expected == reference[PROMPT]
        else:
            assert expected != reference[PROMPT]  # sampling really sampled

        first_chain = [a.as_hop(), b1.as_hop(), c.as_hop()]
        timing = ChainTiming()
        stream = pipeline.generate(
            MODEL,
            first_chain,
            PROMPT,
            params,
            seed=SEED,
            reroute=reroute,
            timeouts=FAST,
            timing=timing,
        )
        got: list[int] = []
        async with aclosing(stream) as tokens:
            async for token in tokens:
                got.append(token)
                if len(got) == kill_after:
                    b1.stop()
                    dead.add(b1.node_id)
        assert got == expected
        assert len(failures) == 1
        assert failures[0].step == kill_after
        assert failures[0].nodes == {"a", "b1", "c"}
        # Timing describes the chain that finished: the replay was its prefill.
        assert timing.nodes == ["a", "b2", "c"]
        assert timing.decode_steps == NEW_TOKENS - kill_after - 1
        assert all(us > 0 for us in timing.prefill_us + timing.decode_us)
        await settle([a, b2, c])
        nursery.cancel_scope.cancel()


async def test_failure_without_reroute_raises(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        chain = [node.as_hop() for node in hops]
        hops[2].stop()
        with pytest.raises(PipelineError, match="open timed out") as info:
            await collect(pipeline, chain, timeouts=Timeouts(open_s=0.3))
        assert info.value.failure.suspects == {"hop2"}
        await settle(hops[:2])
        nursery.cancel_scope.cancel()


async def test_a_stale_route_is_refused_at_open(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        shardless = await start_node(nursery, "shardless")
        claims = [hops[0].as_hop(), Hop("shardless", shardless.address, (3, 6)), hops[2].as_hop()]
        with trio.fail_after(1.0), pytest.raises(PipelineError, match="wrong_shard") as info:
            await collect(pipeline, claims)  # answered at once, no open timeout
        assert info.value.failure.suspects == {"shardless"}
        misplaced = [hops[0].as_hop(), Hop("hop2", hops[2].address, (3, 6)), hops[2].as_hop()]
        with trio.fail_after(1.0), pytest.raises(PipelineError, match="wrong_shard") as info:
            await collect(pipeline, misplaced)
        assert info.value.failure.suspects == {"hop2"}
        await settle(hops)
        nursery.cancel_scope.cancel()


async def test_chain_must_tile_the_layers() -> None:
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        bad = [Hop("x", "tcp://127.0.0.1:1", (0, 3)), Hop("y", "tcp://127.0.0.1:2", (4, 8))]
        with pytest.raises(ValueError, match="contiguous"):
            await collect(entry.engine.pipeline, bad)
        nursery.cancel_scope.cancel()
