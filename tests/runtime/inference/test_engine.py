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

The planes are CurveZMQ-authenticated, so every message's sender is a
fact, and sessions are bound to peers: the last section plays a third node
that learns session ids (as a sniffer of headers would) and tries to use
them. Its forwards, closes and forged replies are dropped and counted, and
the generation under attack still yields exactly the reference tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import trio

from mesh.identity import Identity, PlaneKeys
from mesh.transport import Plane, open_planes
from mesh.wire import decode_tensor
from runtime.inference.chain import ChainHop, ChainTiming, Failure, Pipeline, PipelineError
from runtime.inference.deadlines import Deadlines
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import MAX_SESSION_SHARE, HopServer
from runtime.inference.protocol import encode_message, new_session_id
from runtime.model.backends import load_shard
from runtime.model.backends.base import ShardBackend, ShardSpec
from runtime.model.sampling import SamplingParams

MODEL = "tiny-qwen3"
SPANS = ((0, 3), (3, 6), (6, 8))
PROMPT = (5, 40, 99, 250, 7, 12, 301)
OTHER_PROMPT = (17, 3, 260, 88)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=NEW_TOKENS)
SEED = 1234
LOOPBACK = "tcp://127.0.0.1:0"
# Tight enough that a dead hop is noticed within about a second (the hops
# carry no measured pace here, so each is expected at UNMEASURED_PACE: a
# decode step's deadline is 0.5 + 4 * 3 * 0.05 = 1.1 s), loose enough for a
# loaded 2-core CI box (a tiny-model step takes ~1-3 ms).
FAST = Deadlines(floor_s=0.5)
# For the attack scenarios, which assert that nothing fails: a step that is
# merely slow on a loaded box must not look like an attack that succeeded.
PATIENT = Deadlines()
SCENARIO_S = 10.0  # bounds a whole attack scenario (about a second unloaded)
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
    out: dict[tuple[int, ...], list[int]] = {}
    with torch.no_grad():
        for prompt in (PROMPT, OTHER_PROMPT):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out[prompt] = ids[0, len(prompt) :].tolist()
    return out


def new_keys() -> PlaneKeys:
    return Identity.generate().plane_keys()


@dataclass
class Node:
    """A running test node: its engine, drops, and a way to kill it.

    ``name`` is only for reading the tests; ``node_id`` is the real id (hex)
    its planes prove in every handshake."""

    name: str
    node_id: str
    engine: Engine
    drops: Counter[str]
    address: str
    scope: trio.CancelScope

    @property
    def node(self) -> bytes:
        return bytes.fromhex(self.node_id)

    @property
    def plane(self) -> Plane:
        return self.engine.plane

    @property
    def hop(self) -> HopServer:
        assert self.engine.hop_server is not None
        return self.engine.hop_server

    def as_hop(self) -> ChainHop:
        spec = self.hop.shard.spec
        return ChainHop(self.node_id, self.address, (spec.start, spec.end))

    def stop(self) -> None:
        """Like a crashed process: the planes close, nothing more is said."""
        self.scope.cancel()


async def _serve_node(
    name: str,
    shard: ShardBackend | None,
    limits: dict[str, Any],
    *,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.CancelScope() as scope:
        drops: Counter[str] = Counter()
        identity = Identity.generate()
        keys = identity.plane_keys()
        async with open_planes(LOOPBACK, LOOPBACK, drops=drops, keys=keys) as (_control, data):
            hop = None
            hop_class = limits.pop("hop_class", None) or HopServer  # a test's own, e.g. a liar
            if shard is not None:
                hop = hop_class(data, shard, model=MODEL, drops=drops, signer=identity, **limits)
            engine = Engine(data, drops=drops, signer=identity, hop_server=hop)
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                node_id = data.keys.node_id.hex()
                task_status.started(Node(name, node_id, engine, drops, data.address, scope))


async def start_node(
    nursery: trio.Nursery, name: str, shard: ShardBackend | None = None, **limits: Any
) -> Node:
    node: Node = await nursery.start(_serve_node, name, shard, limits)
    return node


async def start_chain(
    nursery: trio.Nursery, shards: Sequence[ShardBackend], **limits: Any
) -> tuple[Node, list[Node]]:
    """An entry (no shard) and one hop per shard, in chain order."""
    entry = await start_node(nursery, "entry")
    hops = [await start_node(nursery, f"hop{i}", s, **limits) for i, s in enumerate(shards)]
    return entry, hops


async def collect(
    pipeline: Pipeline,
    chain: Sequence[ChainHop],
    prompt: Sequence[int] = PROMPT,
    params: SamplingParams = GREEDY,
    **kwargs: Any,
) -> list[int]:
    kwargs.setdefault("deadlines", FAST)
    stream = pipeline.generate(MODEL, chain, prompt, params, seed=SEED, **kwargs)
    async with aclosing(stream) as tokens:
        return [token async for token in tokens]


async def settle(nodes: Sequence[Node]) -> None:
    """Wait until every hop has closed all its sessions."""
    with trio.fail_after(SETTLE_S):
        while any(node.hop.sessions for node in nodes):
            await trio.sleep(0.01)


@asynccontextmanager
async def bare_plane() -> AsyncIterator[Plane]:
    """The data plane of a node with no engine: the test speaks for it by
    hand (it has its own identity, like any other node)."""
    async with open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=new_keys()) as (_, data):
        yield data


def open_header(peer: Plane, session: str, **fields: Any) -> dict[str, Any]:
    """An ``open`` of the first shard from ``peer`` as the entry; unless
    ``fields`` say otherwise, ``peer`` plays the next hop too."""
    me = peer.keys.node_id.hex()
    return {
        "op": "open",
        "session": session,
        "model": MODEL,
        "layers": list(SPANS[0]),
        "reply": peer.address,
        "budget": 64,
        "prev": me,
        "next": peer.address,
        "next_node": me,
        "next_session": new_session_id(),
        "sampling": None,
        "seed": 0,
        "sketch_seed": 0,
        "check": None,
        **fields,
    }


async def receive_header(plane: Plane, sender: Node | None = None) -> dict[str, Any]:
    """The next message's header on a bare test plane (bounded wait), past
    the hop's commitments (tests/runtime/inference/test_verify_engine.py studies those); when
    ``sender`` is given, the plane must have authenticated it as the sender."""
    with trio.fail_after(SETTLE_S):
        while True:
            peer, frames = await plane.receive()
            header, *_ = decode_tensor(frames)
            if header.get("op") != "commit":
                break
    if sender is not None:
        assert peer == sender.node
    return header


# --- generation -------------------------------------------------------------------


async def test_greedy_three_hops_equals_transformers_generate(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        pipeline = entry.engine.pipeline
        chain = [node.as_hop() for node in hops]
        timing = ChainTiming()
        assert await collect(pipeline, chain, timing=timing) == reference[PROMPT]
        await settle(hops)  # closing released the session on every hop
        # Every hop computed the prompt once and each later token once...
        assert timing.nodes == [node.node_id for node in hops]
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
        entry, hops = await start_chain(nursery, shards)
        pipeline = entry.engine.pipeline
        assert await collect(pipeline, [node.as_hop() for node in hops]) == reference[PROMPT]
        nursery.cancel_scope.cancel()


async def test_concurrent_sessions_do_not_interfere(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    results: dict[tuple[int, ...], list[int]] = {}

    async def run(pipeline: Pipeline, chain: list[ChainHop], prompt: tuple[int, ...]) -> None:
        results[prompt] = await collect(pipeline, chain, prompt)

    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        pipeline = entry.engine.pipeline
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
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        pipeline = entry.engine.pipeline
        chain = [node.as_hop() for node in hops]
        stream = pipeline.generate(MODEL, chain, PROMPT, GREEDY, seed=SEED, deadlines=FAST)
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
        async with bare_plane() as peer:  # the entry, and the next hop too

            async def activations() -> np.ndarray:
                with trio.fail_after(SETTLE_S):
                    while True:  # past the hop's commitments
                        sender, frames = await peer.receive()
                        header, dtype, shape, raw = decode_tensor(frames)
                        if header["op"] != "commit":
                            break
                assert sender == hop.node
                assert header["op"] == "forward", header
                return np.frombuffer(raw, dtype=dtype).reshape(shape)

            def send(message: list[Any]) -> None:
                peer.send(hop.address, message, peer=hop.node)

            session = new_session_id()
            send(encode_message(open_header(peer, session)))

            def step(index: int, pos: int, tokens: Sequence[int]) -> list[Any]:
                header = {"op": "forward", "session": session, "step": index, "pos": pos}
                return encode_message(header, np.array(tokens, np.int64))

            assert (await receive_header(peer, hop))["op"] == "opened"
            send(step(0, 0, PROMPT))
            got = [await activations()]

            release = trio.Event()
            holding = trio.Event()

            def hold_shard() -> None:
                trio.from_thread.run_sync(holding.set)
                trio.from_thread.run(release.wait)

            nursery.start_soon(hop.hop.on_shard, hold_shard)
            await holding.wait()
            for i, token in enumerate(decode_tokens[:3]):
                send(step(i + 1, len(PROMPT) + i, [token]))
            await trio.sleep(0.2)  # all three arrive while the shard is held
            release.set()
            got += [await activations() for _ in range(3)]
            # The shard is free again: the next step runs from the receive loop.
            send(step(4, len(PROMPT) + 3, decode_tokens[3:]))
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
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS], max_sessions=1)
        pipeline = entry.engine.pipeline
        chain = [node.as_hop() for node in hops]
        first = pipeline.generate(MODEL, chain, PROMPT, GREEDY, seed=SEED, deadlines=FAST)
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
        entry, hops = await start_chain(
            nursery, [torch_shards[s] for s in SPANS], idle_timeout_s=idle_s
        )
        pipeline = entry.engine.pipeline
        chain = [node.as_hop() for node in hops]
        stream = pipeline.generate(MODEL, chain, PROMPT, GREEDY, seed=SEED, deadlines=FAST)
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
        entry, hops = await start_chain(
            nursery, [torch_shards[s] for s in SPANS], max_budget=len(PROMPT) + 4
        )
        pipeline = entry.engine.pipeline
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
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        pipeline = entry.engine.pipeline
        first = hops[0]
        async with bare_plane() as peer:

            async def reply() -> dict[str, Any]:
                return await receive_header(peer, first)

            def send(message: list[Any]) -> None:
                peer.send(first.address, message, peer=first.node)

            ghost = {"op": "forward", "session": new_session_id(), "step": 0, "pos": 0}
            header_frame, _ = _raw(ghost, np.array([1], np.int64))
            send([b"\xff\x00garbage"])  # not a tensor frame pair
            send([header_frame, b"\x00" * 3])  # raw frame does not match the shape
            send([b"\x1c", b""])  # malformed CBOR header
            send(_raw({"op": "explode"}))
            send(_raw(ghost, np.array([1], np.int64)))
            send(_raw({"op": "forward", "step": 0, "pos": 0}))  # no session
            send(_raw({"op": "close", "session": "not-hex"}))
            send(_raw({"op": "open", "session": new_session_id(), "reply": 7}))
            # Bigger than a whole budget of inputs: refused before decoding.
            send([header_frame, b"\x00" * (first.engine.max_message_bytes + 1)])
            # An entry takes replies only: headers and commitments' sketches.
            too_big = b"\x00" * (entry.engine.max_message_bytes + 1)
            peer.send(entry.address, [header_frame, too_big], peer=entry.node)

            # An open with a reply address is answered, even when refused.
            wrong = new_session_id()
            good_open = open_header(peer, wrong, next=hops[1].address, next_node=hops[1].node_id)
            send(_raw({**good_open, "model": "some-other-model"}))
            answer = await reply()
            assert answer["op"] == "error" and answer["session"] == wrong
            assert answer["reason"].startswith("wrong_shard")
            # The first hop takes its inputs only from the entry that opens
            # it, and every hop needs a real node id for the next hop.
            for bad in ({"prev": hops[1].node_id}, {"next_node": "hop1"}):
                session = new_session_id()
                send(_raw({**good_open, "session": session, **bad}))
                answer = await reply()
                assert answer["op"] == "error" and answer["session"] == session
                assert answer["reason"].startswith("bad_field")

            # A real session, then steps that break its rules: each is answered
            # with an error, which also ends the session.
            async def open_session() -> str:
                session = new_session_id()
                send(_raw({**good_open, "session": session}))
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
                send(_raw(step, inputs))
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
            "engine.bad_field": 7,
            "engine.wrong_shard": 1,
            "engine.bad_payload": 1,
            "engine.bad_position": 1,
            "engine.budget_exceeded": 1,
            "engine.shard_failed": 1,
            "engine.oversized": 1,
        }
        assert {k: first.drops[k] for k in expected} == expected
        with trio.fail_after(SETTLE_S):
            while entry.drops["engine.oversized"] < 1:
                await trio.sleep(0.01)
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

        async def reroute(failure: Failure) -> list[ChainHop] | None:
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
            deadlines=FAST,
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
        assert failures[0].nodes == {a.node_id, b1.node_id, c.node_id}
        # The step's reports name the dead hop: the one before it reported
        # the step, it never did.
        assert failures[0].suspects == {b1.node_id}
        stall = failures[0].stall
        assert stall is not None and (stall.index, stall.silent) == (1, True)
        # Timing describes the chain that finished: the replay was its prefill.
        assert timing.nodes == [a.node_id, b2.node_id, c.node_id]
        assert timing.decode_steps == NEW_TOKENS - kill_after - 1
        assert all(us > 0 for us in timing.prefill_us + timing.decode_us)
        await settle([a, b2, c])
        nursery.cancel_scope.cancel()


async def test_failure_without_reroute_raises(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        pipeline = entry.engine.pipeline
        chain = [node.as_hop() for node in hops]
        hops[2].stop()
        with pytest.raises(PipelineError, match="open timed out") as info:
            await collect(pipeline, chain, deadlines=Deadlines(open_s=0.3))
        assert info.value.failure.suspects == {hops[2].node_id}
        await settle(hops[:2])
        nursery.cancel_scope.cancel()


async def test_a_stale_route_is_refused_at_open(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        pipeline = entry.engine.pipeline
        shardless = await start_node(nursery, "shardless")
        claims = [
            hops[0].as_hop(),
            ChainHop(shardless.node_id, shardless.address, (3, 6)),
            hops[2].as_hop(),
        ]
        with trio.fail_after(1.0), pytest.raises(PipelineError, match="wrong_shard") as info:
            await collect(pipeline, claims)  # answered at once, no open timeout
        assert info.value.failure.suspects == {shardless.node_id}
        # The right node at its address, but not holding the layers claimed.
        misplaced = [
            hops[0].as_hop(),
            ChainHop(hops[2].node_id, hops[2].address, (3, 6)),
            hops[2].as_hop(),
        ]
        with trio.fail_after(1.0), pytest.raises(PipelineError, match="wrong_shard") as info:
            await collect(pipeline, misplaced)
        assert info.value.failure.suspects == {hops[2].node_id}
        await settle(hops)
        nursery.cancel_scope.cancel()


async def test_a_route_naming_the_wrong_node_for_an_address_never_delivers(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    """A route that pairs an address with another node's id (a stale record
    after the address changed hands, or a lie) cannot reach whoever listens
    there: the entry connects expecting that id's key, the node at the
    address cannot prove it, the handshake fails and the open is never
    delivered. The entry gives up on its open timeout, suspecting the node
    it named, and the node at the address heard nothing at all."""
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, [torch_shards[s] for s in SPANS])
        pipeline = entry.engine.pipeline
        impostor = Identity.generate().node_id.hex()
        claims = [hops[0].as_hop(), ChainHop(impostor, hops[1].address, (3, 6)), hops[2].as_hop()]
        with trio.fail_after(SETTLE_S):
            with pytest.raises(PipelineError, match="open timed out") as info:
                await collect(pipeline, claims, deadlines=Deadlines(open_s=0.5))
            assert info.value.failure.suspects == {impostor}
            while not entry.drops["data.handshake_failed"]:
                await trio.sleep(0.01)
        assert hops[1].plane.received_messages == 0
        assert hops[1].hop.sessions == 0
        await settle(hops)
        # The same address under its real id is the same hop as ever.
        chain = [node.as_hop() for node in hops]
        with trio.fail_after(SETTLE_S):
            assert await collect(pipeline, chain) == reference[PROMPT]
        nursery.cancel_scope.cancel()


async def test_chain_must_tile_the_layers() -> None:
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        x, y = (Identity.generate().node_id.hex() for _ in range(2))
        bad = [ChainHop(x, "tcp://127.0.0.1:1", (0, 3)), ChainHop(y, "tcp://127.0.0.1:2", (4, 8))]
        with pytest.raises(ValueError, match="contiguous"):
            await collect(entry.engine.pipeline, bad)
        # A hop is a node id, not a name: anything else is refused up front.
        for name in ("x", x.upper(), x[:-2]):
            named = [ChainHop(name, "tcp://127.0.0.1:1", (0, 8))]
            with pytest.raises(ValueError, match="not a node id"):
                await collect(entry.engine.pipeline, named)
        nursery.cancel_scope.cancel()


# --- sessions are bound to peers ------------------------------------------------------
#
# Mallory is a third node of the swarm: her planes are as authenticated as
# anyone's, and she has learned the session ids of a generation in flight
# (here read from the hops' tables, as a sniffer of headers would). The
# planes tell every receiver that it is she who speaks, and a session listens
# only to the peers it is bound to.


def session_of(node: Node) -> str:
    """The one session a hop holds: what a sniffer would have learned."""
    (session,) = node.hop._sessions
    return session


async def wait_until_dropped(node: Node, count: int) -> None:
    """Until ``node`` has dropped ``count`` messages as not its sessions' peer's."""
    with trio.fail_after(SETTLE_S):
        while node.drops["engine.not_session_peer"] < count:
            await trio.sleep(0.01)
    assert node.drops["engine.not_session_peer"] == count


Attack = Callable[[Node, list[Node], Node], Awaitable[None]]
"""What a third node does while a generation runs: (mallory, hops, entry)."""


async def attack_mid_generation(
    shards: dict[tuple[int, int], ShardBackend], reference: list[int], attack: Attack
) -> list[Node]:
    """Run a greedy generation through three hops while `attack` runs after
    its first token; the answer must be the reference all the same. The
    hops, settled (every session closed by the entry)."""
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, [shards[s] for s in SPANS])
        mallory = await start_node(nursery, "mallory")
        chain = [node.as_hop() for node in hops]
        stream = entry.engine.pipeline.generate(
            MODEL, chain, PROMPT, GREEDY, seed=SEED, deadlines=PATIENT
        )
        with trio.fail_after(SCENARIO_S):
            async with aclosing(stream) as tokens:
                got = [await anext(tokens)]
                await attack(mallory, hops, entry)
                got += [token async for token in tokens]
        assert got == reference
        await settle(hops)
        nursery.cancel_scope.cancel()
    return hops


async def test_a_third_node_cannot_forward_into_a_sniffed_session(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async def forward_into_sessions(mallory: Node, hops: list[Node], entry: Node) -> None:
        # Mallory pushes her own inputs into every hop's session: a token
        # into the first, hidden states into the others. Taken, they would
        # poison the caches (or break the positions) and change every token
        # after them.
        for i, node in enumerate(hops):
            pos = len(PROMPT) + 1
            header = {"op": "forward", "session": session_of(node), "step": 2, "pos": pos}
            if i == 0:
                inputs = np.array([66], np.int64)
            else:
                inputs = np.full((1, node.hop.shard.hidden_size), 1e4, np.float32)
            mallory.plane.send(node.address, encode_message(header, inputs), peer=node.node)
        for node in hops:
            await wait_until_dropped(node, 1)

    hops = await attack_mid_generation(torch_shards, reference[PROMPT], forward_into_sessions)
    # Nothing of hers was computed: each hop ran the prompt and each later
    # token once, and no session saw an error.
    for node in hops:
        stats = node.engine.hop_stats
        assert stats is not None
        assert (stats["prefill_steps"], stats["decode_steps"]) == (1, NEW_TOKENS - 1)
        assert {k for k in node.drops if k.startswith("engine.")} == {"engine.not_session_peer"}


async def test_a_third_node_cannot_close_a_live_session(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async def close_sessions(mallory: Node, hops: list[Node], entry: Node) -> None:
        # Close is idempotent and has no reply: were it taken from anyone,
        # one message would end a stranger's generation.
        for node in hops:
            close = encode_message({"op": "close", "session": session_of(node)})
            mallory.plane.send(node.address, close, peer=node.node)
        for node in hops:
            await wait_until_dropped(node, 1)
        assert [node.hop.sessions for node in hops] == [1, 1, 1]

    # The entry's own close, at the end, is taken (the hops settle).
    await attack_mid_generation(torch_shards, reference[PROMPT], close_sessions)


async def test_a_third_node_cannot_forge_replies_to_the_entry(
    torch_shards: dict[tuple[int, int], ShardBackend],
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    async def forge_replies(mallory: Node, hops: list[Node], entry: Node) -> None:
        # Tokens carry the last hop's session id. Mallory answers in its
        # name, for the step in flight and the next one, with a token of her
        # choosing (666, never in the reference); then she reports the
        # session failed.
        last = session_of(hops[-1])
        forged = [
            {"op": "token", "session": last, "step": step, "token": 666} | {"compute_us": [1, 1, 1]}
            for step in (1, 2)
        ]
        forged.append({"op": "error", "session": last, "step": 2, "reason": "shard_failed"})
        for header in forged:
            mallory.plane.send(entry.address, encode_message(header), peer=entry.node)
        await wait_until_dropped(entry, len(forged))

    assert 666 not in reference[PROMPT]
    await attack_mid_generation(torch_shards, reference[PROMPT], forge_replies)


async def test_one_peer_holds_at_most_its_share_of_a_hops_sessions(
    torch_shards: dict[tuple[int, int], ShardBackend],
) -> None:
    max_sessions = 4
    share = int(max_sessions * MAX_SESSION_SHARE)
    assert 1 <= share < max_sessions
    async with trio.open_nursery() as nursery:
        hop = await start_node(nursery, "hop", torch_shards[SPANS[0]], max_sessions=max_sessions)
        async with bare_plane() as mallory, bare_plane() as alice:

            async def open_session(peer: Plane) -> tuple[str, dict[str, Any]]:
                session = new_session_id()
                peer.send(hop.address, encode_message(open_header(peer, session)), peer=hop.node)
                answer = await receive_header(peer, hop)
                assert answer["session"] == session
                return session, answer

            # Mallory asks for every session the hop has; she gets her share.
            held = []
            for _ in range(share):
                session, answer = await open_session(mallory)
                assert answer == {"op": "opened", "session": session}
                held.append(session)
            for _ in range(max_sessions - share):
                _, answer = await open_session(mallory)
                assert answer["op"] == "busy" and "holds its share" in answer["reason"]
            assert hop.drops["engine.busy"] == max_sessions - share
            # Alice, another entry, is still served.
            session, answer = await open_session(alice)
            assert answer == {"op": "opened", "session": session}
            assert hop.hop.sessions == share + 1
            # The share bounds what a peer holds at once, not what it ever opens.
            close = encode_message({"op": "close", "session": held.pop()})
            mallory.send(hop.address, close, peer=hop.node)
            with trio.fail_after(SETTLE_S):
                while hop.hop.sessions > share:
                    await trio.sleep(0.01)
            session, answer = await open_session(mallory)
            assert answer == {"op": "opened", "session": session}
        nursery.cancel_scope.cancel()
