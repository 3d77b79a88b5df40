"""Commitments and spot-check replays over real planes and real torch shards, in one process.

Every hop signs a sketch of each step (runtime.inference.commitment); a
replay of the finished request on other nodes with the same spans finds the
first hop whose output disagrees while its input agreed
(runtime.inference.transcript). These scenarios use the engine test's nodes
(tests/runtime/inference/test_engine.py): an honest swarm is never accused, whatever the
sampling; a hop that adds noise always, or on one step only, is named at
that step; a last hop that emits another token is named by the token check;
the evidence survives a trip through JSON and convicts on the leader's own
recomputation, and a forged or altered commitment does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from mesh.identity import Identity
from runtime.inference.chain import ChainHop, Pipeline, replay
from runtime.inference.commitment import SIGN_EVERY, SKETCH_DIMS, Commitment, ids_digest, sketch
from runtime.inference.hop_server import HopServer
from runtime.inference.protocol import encode_message
from runtime.inference.transcript import Transcript, find_divergence, judge_step, rows_agree
from runtime.model.backends.base import ShardBackend
from runtime.model.sampling import SamplingParams, sample
from runtime.node.spot_check import Evidence, tolerance
from tests.runtime.inference.test_engine import (
    GREEDY,
    MODEL,
    PATIENT,
    PROMPT,
    SAMPLED,
    SEED,
    SPANS,
    _load,
    start_node,
)

FP32 = tolerance(["fp32"])
NOISE = 0.5
"""Noise a lying hop adds, relative to its output's spread: the "three
different garbage answers to three identical requests" of the issue."""


class NoisyShard:
    """A real shard that adds noise to its output on the forwards
    ``lie_on`` selects (0-based count of forwards): an attacker, not a mock."""

    def __init__(self, shard: ShardBackend, lie_on: set[int] | None, seed: int = 7) -> None:
        self._shard = shard
        self._lie_on = lie_on
        self._calls = 0
        self._rng = np.random.default_rng(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray:
        output = self._shard.forward(inputs, positions, cache)
        call, self._calls = self._calls, self._calls + 1
        if self._lie_on is None or call in self._lie_on:
            noise = self._rng.standard_normal(output.shape).astype(np.float32)
            output = output + NOISE * float(output.std()) * noise
        return output


class SwappingHop(HopServer):
    """A last hop that emits the next token id instead of the one it
    sampled, and signs that: a patched node (the issue's case c)."""

    def _compute_step(self, session: Any, work: Any) -> Any:
        import runtime.inference.hop_server as hop_module

        honest = hop_module.sample
        vocab = self.shard.vocab_size

        def swapped(logits: np.ndarray, params: SamplingParams, **given: Any) -> int:
            return (honest(logits, params, **given) + 1) % vocab

        hop_module.sample = swapped  # type: ignore[assignment]
        try:
            return super()._compute_step(session, work)
        finally:
            hop_module.sample = honest


@pytest.fixture(scope="module")
def shards(qwen3_dir: Path) -> dict[tuple[int, int], ShardBackend]:
    return {span: _load(qwen3_dir, span, "torch") for span in SPANS}


async def _generate(
    pipeline: Pipeline, chain: Sequence[ChainHop], params: SamplingParams
) -> Transcript:
    transcript = Transcript()
    stream = pipeline.generate(
        MODEL, chain, PROMPT, params, seed=SEED, deadlines=PATIENT, transcript=transcript
    )
    async with aclosing(stream) as tokens:
        async for _ in tokens:
            pass
    with trio.fail_after(5):  # a middle hop's last commitment, and the seals, trail the token
        while not transcript.complete():
            await trio.sleep(0.01)
    return transcript


async def _swarm(
    nursery: trio.Nursery,
    shards: dict[tuple[int, int], ShardBackend],
    served: Sequence[ShardBackend],
    hop_class: type[HopServer] = HopServer,
) -> tuple[Pipeline, list[ChainHop], list[ChainHop]]:
    """An entry, the chain under test (``served``, one per span) and an
    honest second chain to check it with."""
    entry = await start_node(nursery, "entry")
    checked = []
    for i, shard in enumerate(served):
        last = i == len(served) - 1
        node = await start_node(nursery, f"hop{i}", shard, hop_class=hop_class if last else None)
        checked.append(node.as_hop())
    honest = [
        (await start_node(nursery, f"check{i}", shards[s])).as_hop() for i, s in enumerate(SPANS)
    ]
    return entry.engine.pipeline, checked, honest


async def _check(pipeline: Pipeline, transcript: Transcript, chain: list[ChainHop]) -> Any:
    result = await replay(pipeline, chain, transcript, sketch_seeds=transcript.sketch_seeds)
    return find_divergence(transcript, result, FP32)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_an_honest_chain_agrees_with_its_replay_on_every_step(
    shards: dict[tuple[int, int], ShardBackend], params: SamplingParams
) -> None:
    async with trio.open_nursery() as nursery:
        pipeline, chain, honest = await _swarm(nursery, shards, [shards[s] for s in SPANS])
        transcript = await _generate(pipeline, chain, params)
        assert len(transcript.tokens) == params.max_tokens
        signed = 0
        for (index, step), commitment in transcript.commitments.items():
            assert transcript.proven(index, step) and commitment.hop == chain[index].node
            signed += bool(commitment.signature)
        # One signature in SIGN_EVERY steps, plus each session's first and last.
        assert signed <= len(chain) * (2 + len(transcript.steps()) // SIGN_EVERY)
        assert await _check(pipeline, transcript, honest) is None
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("lie_on", "step"), [(None, 0), ({9}, 9)], ids=["always", "one_step"])
async def test_a_noisy_middle_hop_is_named_at_the_step_it_lied(
    shards: dict[tuple[int, int], ShardBackend], lie_on: set[int] | None, step: int
) -> None:
    liar = NoisyShard(shards[SPANS[1]], lie_on)
    async with trio.open_nursery() as nursery:
        served = [shards[SPANS[0]], liar, shards[SPANS[2]]]
        pipeline, chain, honest = await _swarm(nursery, shards, served)  # type: ignore[list-item]
        transcript = await _generate(pipeline, chain, GREEDY)
        found = await _check(pipeline, transcript, honest)
        assert found is not None
        assert (found.kind, found.hop_index, found.step) == ("output", 1, step)
        assert found.commitment is not None and transcript.proven(1, step)
        nursery.cancel_scope.cancel()


async def test_a_last_hop_that_swaps_tokens_is_named_by_the_token_check(
    shards: dict[tuple[int, int], ShardBackend],
) -> None:
    async with trio.open_nursery() as nursery:
        served = [shards[s] for s in SPANS]
        pipeline, chain, honest = await _swarm(nursery, shards, served, SwappingHop)
        transcript = await _generate(pipeline, chain, SAMPLED)
        found = await _check(pipeline, transcript, honest)
        assert found is not None
        assert (found.kind, found.hop_index, found.step) == ("token", 2, 0)
        nursery.cancel_scope.cancel()


async def test_evidence_convicts_on_an_independent_recomputation_and_forgery_does_not(
    shards: dict[tuple[int, int], ShardBackend],
) -> None:
    liar = NoisyShard(shards[SPANS[1]], None)
    async with trio.open_nursery() as nursery:
        served = [shards[SPANS[0]], liar, shards[SPANS[2]]]
        pipeline, chain, honest = await _swarm(nursery, shards, served)  # type: ignore[list-item]
        transcript = await _generate(pipeline, chain, GREEDY)
        found = await _check(pipeline, transcript, honest)
        assert found is not None and found.commitment is not None
        evidence = Evidence(
            reporter=found.commitment.entry,
            kind=found.kind,
            hop_index=found.hop_index,
            model=MODEL,
            prompt=transcript.prompt,
            tokens=tuple(transcript.tokens),
            sampling=transcript.sampling,
            seed=transcript.seed,
            layers=tuple(transcript.chain_layers),
            commitment=found.commitment,
        )
        carried = Evidence.from_json(evidence.to_json())
        assert carried.digest() == evidence.digest()

        async def judged(evidence: Evidence) -> Any:
            seeds = [7, evidence.commitment.sketch_seed, 9]
            judge = evidence.transcript(honest)
            result = await replay(pipeline, honest, judge, sketch_seeds=seeds)
            return judge_step(judge, result, evidence.hop_index, evidence.commitment.step, FP32)

        verdict = await judged(carried)
        assert verdict is not None and verdict.kind == "output"
        # A reporter that alters the commitment breaks its signature...
        body = evidence.to_json()
        body["commitment"]["step"] += 1
        with pytest.raises(ValueError, match="signature"):
            Evidence.from_json(body)
        # ...and one that changes the request cannot make an honest hop's
        # commitment disagree: its input no longer matches.
        honest_transcript = await _generate(pipeline, honest, GREEDY)
        commitment = honest_transcript.commitments[(1, 0)]
        framed = Evidence(
            reporter=commitment.entry,
            kind="output",
            hop_index=1,
            model=MODEL,
            prompt=(1, *honest_transcript.prompt[1:]),
            tokens=tuple(honest_transcript.tokens),
            sampling=honest_transcript.sampling,
            seed=honest_transcript.seed,
            layers=tuple(honest_transcript.chain_layers),
            commitment=commitment,
        )
        verdict = await judged(framed)
        assert verdict is not None and verdict.kind == "transit"
        nursery.cancel_scope.cancel()


def test_sketches_detect_noise_and_pass_rounding() -> None:
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((5, 64)).astype(np.float32)
    base = sketch(hidden, 42)
    assert base.shape == (5, SKETCH_DIMS)
    assert np.array_equal(base, sketch(hidden.copy(), 42))
    rounded = hidden * (1 + 1e-6 * rng.standard_normal(hidden.shape).astype(np.float32))
    assert rows_agree(sketch(rounded, 42), base, FP32)
    noisy = hidden + 0.05 * rng.standard_normal(hidden.shape).astype(np.float32)
    assert not rows_agree(sketch(noisy, 42), base, FP32)
    assert not np.allclose(sketch(hidden, 43), base)  # another seed, other directions


def signed_commitment(
    hop: Identity,
    entry: bytes,
    *,
    layers: tuple[int, int],
    ids: Sequence[int],
    token: int | None,
    model: str = MODEL,
) -> Commitment:
    """A first hop's commitment to ``ids`` made up by a test and signed by
    ``hop``: well formed, but no shard computed it."""
    return Commitment(
        hop=hop.node_id,
        entry=entry,
        session="ab" * 16,
        model=model,
        layers=layers,
        sketch_seed=5,
        step=0,
        pos=0,
        count=len(ids),
        inputs_digest=ids_digest(np.array(ids)),
        inputs=np.zeros((0, SKETCH_DIMS), np.float32),
        outputs=np.ones((1 if token is not None else len(ids), SKETCH_DIMS), np.float32),
        token=token,
    ).signed(hop)


def test_a_commitment_binds_every_field_it_signs() -> None:
    hop, entry = Identity.generate(), Identity.generate()
    commitment = signed_commitment(hop, entry.node_id, layers=(0, 3), ids=[1, 2], token=None)
    assert commitment.verified()
    assert Commitment.from_json(commitment.to_json()).verified()
    for field, value in [
        ("entry", hop.node_id),
        ("step", 1),
        ("layers", (0, 4)),
        ("outputs", commitment.outputs * 2),
        ("inputs_digest", ids_digest(np.array([1, 3]))),
    ]:
        assert not Commitment(**{**_fields(commitment), field: value}).verified(), field
    with pytest.raises(ValueError):
        Commitment.from_json({**commitment.to_json(), "outputs": "not base64!"})


def _fields(commitment: Commitment) -> dict[str, Any]:
    return {name: getattr(commitment, name) for name in Commitment.__dataclass_fields__}


def test_greedy_token_margin_is_zero_for_the_argmax() -> None:
    from runtime.model.sampling import token_margin

    logits = np.array([0.1, 2.0, 1.9, -1.0], np.float32)
    best = sample(logits, GREEDY, seed=0, step=0)
    assert token_margin(logits, GREEDY, best, seed=0, step=0) == 0
    assert token_margin(logits, GREEDY, 2, seed=0, step=0) == pytest.approx(0.025)
    assert token_margin(logits, GREEDY, 3, seed=0, step=0) == pytest.approx(0.75)
    for step in range(20):
        drawn = sample(logits, SAMPLED, seed=3, step=step)
        assert token_margin(logits, SAMPLED, drawn, seed=3, step=step) == 0


@pytest.mark.parametrize("noise", [1e-4, 1e-3, 1e-2])
def test_a_sampled_token_is_within_the_rounding_that_moved_it(noise: float) -> None:
    """Logits recomputed with rounding of relative size `noise` (bf16's is
    ~1e-2): the token drawn from the original logits is never further than
    that from the recomputation's draw, near-ties, the top-p edge and the
    borders of shares included; a swapped token mostly is."""
    from runtime.model.sampling import token_margin

    rng = np.random.default_rng(11)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=1)
    swapped_far = 0
    for step in range(300):
        logits = (rng.standard_normal(500) * 3).astype(np.float32)
        scale = float(np.abs(logits).max())
        rounded = logits + (noise * scale * rng.uniform(-1, 1, 500)).astype(np.float32)
        honest = sample(logits, params, seed=5, step=step)
        assert token_margin(rounded, params, honest, seed=5, step=step) <= noise * 1.0001
        swapped = (honest + 1) % 500
        swapped_far += token_margin(rounded, params, swapped, seed=5, step=step) > 2 * noise
    assert swapped_far > 250


class FloodingHop(HopServer):
    """A middle hop that also sends commitments no step of the session
    made: far beyond its budget, with sketches of the wrong shape, and
    with garbage for a signature field. The entry must file none of them
    and lose nothing."""

    def _push(self, session: Any, work: Any, result: Any) -> None:
        super()._push(session, work, result)
        rows = np.zeros((2, SKETCH_DIMS), np.float32)
        base = {
            "op": "commit",
            "session": session.id,
            "pos": 0,
            "count": 1,
            "in_rows": 1,
            "prev": b"",
        }
        bogus = [
            ({**base, "step": 10**6, "in_digest": b"", "sig": b"x" * 64}, rows),
            ({**base, "step": 0, "in_digest": b"", "sig": b"x" * 64}, np.zeros((2, 3), "f4")),
            ({**base, "step": 0, "in_digest": b"", "sig": "text"}, rows),
        ]
        for header, payload in bogus:
            self.plane.send(session.reply, encode_message(header, payload), peer=session.entry)


async def test_bogus_commitments_are_counted_and_never_filed(
    shards: dict[tuple[int, int], ShardBackend],
) -> None:
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        hops = [
            await start_node(
                nursery, f"hop{i}", shards[s], hop_class=FloodingHop if i == 1 else None
            )
            for i, s in enumerate(SPANS)
        ]
        chain = [node.as_hop() for node in hops]
        transcript = await _generate(entry.engine.pipeline, chain, GREEDY)
        assert len(transcript.tokens) == GREEDY.max_tokens
        steps = len(transcript.steps())
        assert len(transcript.commitments) == len(chain) * steps
        assert all(transcript.proven(index, step) for index, step in transcript.commitments)
        with trio.fail_after(5):
            while (
                entry.drops["engine.bad_commitment"] + entry.drops["engine.bad_field"] < 3 * steps
            ):
                await trio.sleep(0.01)
        assert entry.drops["engine.bad_commitment"] == 2 * steps
        assert entry.drops["engine.bad_field"] == steps
        assert transcript.refused == 0
        nursery.cancel_scope.cancel()


def test_an_unsigned_link_is_proven_only_by_an_intact_chain_to_a_signed_one() -> None:
    hop, entry = Identity.generate(), Identity.generate()
    first = signed_commitment(hop, entry.node_id, layers=(0, 3), ids=[1, 2], token=None)
    fields = _fields(first)
    middle = Commitment(
        **{
            **fields,
            "step": 1,
            "pos": 2,
            "count": 1,
            "signature": b"",
            "previous": first.digest(),
            "inputs_digest": ids_digest(np.array([3])),
            "outputs": np.ones((1, SKETCH_DIMS), np.float32),
        }
    )
    last = Commitment(**{**_fields(middle), "step": 2, "pos": 3, "previous": middle.digest()})
    last = last.signed(hop)
    assert not middle.verified() and middle.verified_through([last])
    assert not middle.verified_through([])  # no signed link after it
    altered = Commitment(**{**_fields(middle), "outputs": middle.outputs * 2})
    assert not altered.verified_through([last])  # the chain no longer names it
    stranger = Identity.generate()
    forged = Commitment(**{**_fields(last), "hop": stranger.node_id}).signed(stranger)
    assert not middle.verified_through([forged])  # another hop's signature proves nothing


@pytest.mark.parametrize("recipe", ["bf16", "fp16", "q8"])
def test_a_half_precision_last_hop_is_never_accused_of_its_own_sampled_tokens(
    qwen3_dir: Path, recipe: str
) -> None:
    """The benchmark's false quarantines, as a regression: a bf16 last hop's
    decode steps and a replay's prefill round differently (logits apart by
    ~1% of the largest, and bf16 logits tie often), so near-ties, ties and
    the top_k/top_p edge go either way. Every honest sampled token stays
    within the recipe's tolerance; a swapped one almost never does."""
    from runtime.model.backends import load_shard
    from runtime.model.backends.base import ShardSpec
    from runtime.model.sampling import token_margin

    shard = load_shard(ShardSpec(qwen3_dir, 0, 8, recipe), "torch")
    limit = tolerance([recipe])
    rng = np.random.default_rng(0)
    steps = caught = 0
    worst = 0.0
    for trial in range(6):
        ids = rng.integers(0, shard.vocab_size, 24).astype(np.int64)
        cache = shard.new_cache()
        decoded = [shard.forward(ids[:8], np.arange(8), cache)[-1]]
        for pos in range(8, 24):
            decoded.append(shard.forward(ids[pos : pos + 1], np.array([pos]), cache)[-1])
        replayed = shard.forward(ids, np.arange(24), shard.new_cache())[7:24]
        for step, (served, again) in enumerate(zip(decoded, replayed, strict=True)):
            token = sample(served, SAMPLED, seed=trial, step=step)
            worst = max(worst, token_margin(again, SAMPLED, token, seed=trial, step=step))
            swapped = (token + 1) % shard.vocab_size
            caught += token_margin(again, SAMPLED, swapped, seed=trial, step=step) > limit
            steps += 1
    assert worst <= limit / 4, worst
    assert caught >= 0.9 * steps, (caught, steps)
