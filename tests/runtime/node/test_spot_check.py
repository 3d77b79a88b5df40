"""Spot checks' data: evidence as it travels, what a check accepts to do, the tolerance.

The replays themselves run on real engines in
tests/runtime/inference/test_verify_engine.py and across processes in
tests/processes/test_verify.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import numpy as np
import pytest
import trio

from mesh.coverage import ModelCoverage, ServingNode
from mesh.identity import Identity
from runtime.inference.chat import _blocked_span
from runtime.inference.commitment import SKETCH_DIMS, Commitment
from runtime.inference.transcript import Transcript
from runtime.model.recipes import get_recipe
from runtime.model.sampling import SamplingParams
from runtime.node.spot_check import (
    DISTRUST_S,
    MAX_CHECKED_POSITIONS,
    MAX_PENDING_CHECKS,
    TOLERANCE_FACTOR,
    Evidence,
    SpotChecker,
    tolerance,
)

REPORTER = b"\x0c" * 32


@pytest.fixture(scope="module")
def accused() -> Identity:
    return Identity.generate()


def evidence(accused: Identity, **changed: Any) -> Evidence:
    rows = np.ones((1, SKETCH_DIMS), dtype=np.float32)
    commitment = Commitment(
        accused.node_id, REPORTER, "ab" * 16, "m", (4, 8), 3, 0, 0, 2, b"", rows[:0], rows, 9
    ).signed(accused)
    made = Evidence(
        reporter=REPORTER,
        kind="token",
        hop_index=1,
        model="m",
        prompt=(1, 2),
        tokens=(9,),
        sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=40),
        seed=7,
        layers=((0, 4), (4, 8)),
        commitment=commitment,
    )
    return replace(made, **changed)


def test_evidence_round_trips_as_json(accused: Identity) -> None:
    sent = evidence(accused)
    back = Evidence.from_json(sent.to_json())
    assert back.to_json() == sent.to_json()
    assert back.accused == accused.node_id
    assert back.digest() == sent.digest(), "one verdict per piece of evidence"
    assert evidence(accused, seed=8).digest() != sent.digest()


@pytest.mark.parametrize(
    ("changed", "why"),
    [
        ({"kind": "transit"}, "not one a recomputation can judge"),
        ({"hop_index": 2}, "outside the chain"),
        ({"layers": ((0, 3), (3, 8))}, "another shard"),
        ({"reporter": b"\x0d" * 32}, "another entry"),
        ({"prompt": (1,), "tokens": ()}, "past the request"),
        ({"tokens": ()}, "empty or too long"),
    ],
)
def test_inconsistent_evidence_is_refused(
    accused: Identity, changed: dict[str, Any], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        Evidence.from_json(evidence(accused, **changed).to_json())


def test_an_unsigned_or_forged_commitment_is_refused(accused: Identity) -> None:
    sent = evidence(accused)
    forged = replace(sent, commitment=replace(sent.commitment, token=10))
    with pytest.raises(ValueError, match="signature"):
        Evidence.from_json(forged.to_json())
    with pytest.raises(ValueError, match="malformed evidence"):
        Evidence.from_json({**sent.to_json(), "seed": "x"})


def test_tolerance_is_twice_the_loosest_recipe() -> None:
    assert tolerance(["fp32"]) == TOLERANCE_FACTOR * get_recipe("fp32").tolerance
    loose = max(("fp32", "bf16"), key=lambda r: get_recipe(r).tolerance)
    assert tolerance(["fp32", "bf16"]) == TOLERANCE_FACTOR * get_recipe(loose).tolerance


def checker(fraction: float, draw: float = 0.5) -> SpotChecker:
    async def report(_: Evidence) -> bool:
        return True

    return SpotChecker(
        swarm=cast(Any, None),
        pipeline=cast(Any, None),
        fraction=lambda: fraction,
        report=report,
        random=lambda: draw,
    )


def finished(tokens: int = 3, prompt: int = 4) -> Transcript:
    transcript = Transcript("m", tuple(range(prompt)), SamplingParams(), 1)
    transcript.chain_nodes = [b"\x01" * 32]
    transcript.tokens = list(range(tokens))
    return transcript


def test_consider_checks_with_the_policys_probability() -> None:
    never = checker(fraction=0.0)
    never.consider(finished())
    assert never.counters == {"skipped": 1}
    always = checker(fraction=1.0)
    always.consider(finished(tokens=0))  # nothing generated: nothing to check
    always.consider(finished(prompt=MAX_CHECKED_POSITIONS))
    assert always.counters == {"too_long": 1}
    for _ in range(MAX_PENDING_CHECKS + 1):
        always.consider(finished())
    assert always.counters == {"too_long": 1, "busy": 1}, "a burst past the queue goes unchecked"


async def test_distrust_lasts_its_time(autojump_clock: object) -> None:
    caught = checker(fraction=1.0)
    start = trio.current_time()
    caught._distrust(b"\x05" * 32)
    assert caught.distrusted(start) == frozenset({b"\x05" * 32})
    assert caught.stats_json()["distrusted"] == ["05" * 32]
    assert caught.distrusted(start + DISTRUST_S) == frozenset()


async def test_an_entry_that_distrusts_a_whole_span_asks_for_verdicts(
    autojump_clock: object, accused: Identity
) -> None:
    """Every holder of a span distrusted: a node with signed evidence held
    back has it filed, one with evidence at the leader waits for its
    verdict, one with no signed evidence (a transit divergence names two
    nodes) is avoided no longer; and each is named with why."""
    caught = checker(fraction=1.0)
    ambiguous, held, reported = b"\x05" * 32, accused.node_id, b"\x06" * 32
    caught._distrust(ambiguous, why="transit at step 3")
    caught._distrust(held, why="unconfirmed token divergence at step 1")
    caught._held[held] = evidence(accused)
    caught._distrust(reported, why="output evidence")
    caught._reported[reported] = trio.current_time() + DISTRUST_S
    said = caught.blocked([ambiguous, held, reported])
    assert caught.distrusted(trio.current_time()) == {held, reported}
    assert caught._proofs_out.receive_nowait().digest() == evidence(accused).digest()
    assert "05" * 6 + " (transit at step 3: no signed evidence, so no longer avoided)" in said
    assert "unconfirmed token divergence at step 1: evidence filed with the leader" in said
    assert "output evidence: evidence with the leader, awaiting its verdict" in said


def test_a_span_is_blocked_only_when_every_holder_of_it_is_distrusted() -> None:
    def node(tag: int, layers: tuple[int, int]) -> ServingNode:
        return ServingNode(bytes([tag]) * 32, "alive", layers, "fp32", 1.0, 1.0)

    nodes = (node(1, (0, 2)), node(2, (0, 2)), node(3, (2, 4)), node(4, (0, 4)))
    variant = ModelCoverage("m", "d", "fp32", 4, ((0, 4),), (), (3, 3, 2, 2), nodes, True)
    ids = [n.node_id for n in nodes]
    assert _blocked_span(variant, frozenset(ids[:3])) is None  # the full-model node holds
    assert _blocked_span(variant, frozenset([ids[2], ids[3]])) == ((2, 4), sorted(ids[2:]))
