"""A generation's transcript and the first divergence a replay finds in it.

A synthetic two-hop generation, prompt (5, 6, 7) then tokens (8, 9): step 0
prefills positions 0-2, step 1 decodes position 3. The replay recomputes
positions 0-3 in one step; its last hop judges from position 2 on.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from runtime.inference.commitment import SKETCH_DIMS, Commitment, ids_digest
from runtime.inference.transcript import Replay, Transcript, find_divergence, rows_agree
from runtime.model.sampling import SamplingParams

PROMPT, TOKENS = (5, 6, 7), [8, 9]
IDS = np.array([*PROMPT, *TOKENS[:-1]], dtype=np.int64)
HOPS = [b"\x01" * 32, b"\x02" * 32]
HIDDEN = np.random.default_rng(1).standard_normal((4, SKETCH_DIMS)).astype(np.float32)
LOGITS = np.random.default_rng(2).standard_normal((4, SKETCH_DIMS)).astype(np.float32)
EMPTY = np.zeros((0, SKETCH_DIMS), dtype=np.float32)
TOLERANCE = 1e-3


def made(index: int, step: int, pos: int, count: int, **fields: object) -> Commitment:
    rows = slice(pos, pos + count)
    if index == 0:
        values: dict[str, object] = {
            "inputs_digest": ids_digest(IDS[rows]),
            "inputs": EMPTY,
            "outputs": HIDDEN[rows],
            "token": None,
        }
    else:
        values = {
            "inputs_digest": b"",
            "inputs": HIDDEN[rows],
            "outputs": LOGITS[pos + count - 1 : pos + count],
            "token": TOKENS[step],
        }
    values = {"signature": b"s", **values, **fields}
    return Commitment(
        hop=HOPS[index],
        entry=b"\x09" * 32,
        session=f"{index:032x}",
        model="m",
        layers=((0, 4), (4, 8))[index],
        sketch_seed=index,
        step=step,
        pos=pos,
        count=count,
        **values,  # type: ignore[arg-type]
    )


def transcript(**changed: Commitment | None) -> Transcript:
    """The honest generation, with commitments replaced (or dropped: None)
    by key `h{index}s{step}`."""
    kept = Transcript()
    kept.begin("m", PROMPT, SamplingParams(), 3)
    kept.restart(HOPS, [(0, 4), (4, 8)], [0, 1])
    kept.tokens.extend(TOKENS)
    honest = {
        "h0s0": made(0, 0, 0, 3),
        "h1s0": made(1, 0, 0, 3),
        "h0s1": made(0, 1, 3, 1),
        "h1s1": made(1, 1, 3, 1),
    }
    honest.update(changed)
    for key, value in honest.items():
        if value is not None:
            kept.add(int(key[1]), value)
    return kept


REPLAY = Replay(
    commitments=(
        made(0, 0, 0, 4),
        replace(made(1, 0, 0, 4), outputs=LOGITS[2:4]),  # judged from position 2 on
    ),
    picks=(8, 9),
    margins=(0.0, 0.0),
)


def test_an_honest_generation_has_no_divergence() -> None:
    assert find_divergence(transcript(), REPLAY, TOLERANCE) is None


@pytest.mark.parametrize(
    ("changed", "kind", "hop", "step"),
    [
        ({"h1s1": made(1, 1, 3, 1, outputs=LOGITS[3:4] + 1.0)}, "output", 1, 1),
        ({"h0s0": made(0, 0, 0, 3, outputs=HIDDEN[0:3] * 2)}, "output", 0, 0),
        ({"h0s1": made(0, 1, 3, 1, inputs_digest=ids_digest(IDS[0:1]))}, "input", 0, 1),
        ({"h1s0": made(1, 0, 0, 3, inputs=HIDDEN[0:3] + 1.0)}, "transit", 1, 0),
        ({"h1s1": made(1, 1, 3, 1, token=4)}, "token", 1, 1),
        ({"h1s0": None}, "missing", 1, 0),
    ],
)
def test_the_first_divergence_names_the_hop_and_step(
    changed: dict[str, Commitment | None], kind: str, hop: int, step: int
) -> None:
    found = find_divergence(transcript(**changed), REPLAY, TOLERANCE)
    assert found is not None
    assert (found.kind, found.hop_index, found.step) == (kind, hop, step)


def test_a_token_the_logits_do_not_give_is_a_token_divergence() -> None:
    lying = Replay(REPLAY.commitments, picks=(8, 3), margins=(0.0, 0.5))
    found = find_divergence(transcript(), lying, TOLERANCE)
    assert found is not None and (found.kind, found.step) == ("token", 1)
    close_call = Replay(REPLAY.commitments, picks=(8, 3), margins=(0.0, TOLERANCE / 2))
    assert find_divergence(transcript(), close_call, TOLERANCE) is None, "within tolerance"


def test_rows_agree_by_relative_error() -> None:
    rows = np.array([[1.0, -2.0], [10.0, 0.0]], dtype=np.float32)
    assert rows_agree(rows, rows * (1 + 1e-4), TOLERANCE)
    assert not rows_agree(rows, rows + 0.1, TOLERANCE)
    assert not rows_agree(rows, rows[:1], TOLERANCE), "shapes differ"
    assert not rows_agree(EMPTY, EMPTY, TOLERANCE), "nothing to agree on"


def test_commitments_kept_once_sealed_and_linked() -> None:
    kept = transcript(h1s1=made(1, 1, 3, 1, signature=b""))
    kept.add(0, made(0, 0, 0, 3, outputs=HIDDEN[0:3] * 2))
    assert kept.refused == 1, "a second commitment for one hop and step is not kept"
    assert not kept.complete(), "hop 1's latest commitment is not signed yet"
    assert kept.links(1, 0) == (kept.commitments[(1, 1)],)
    kept.seal(1, 1, b"sig")
    assert kept.commitments[(1, 1)].signature == b"sig"
    kept.seal(1, 1, b"other")
    assert kept.commitments[(1, 1)].signature == b"sig", "a seal never replaces a signature"
    assert kept.complete()
    assert kept.steps() == [0, 1]


def test_a_new_chain_drops_the_old_chains_commitments() -> None:
    kept = transcript()
    kept.restart(HOPS[::-1], [(0, 4), (4, 8)], [5, 6])
    assert kept.commitments == {} and kept.attempts == 2
    assert kept.chain_nodes == HOPS[::-1] and kept.sketch_seeds == [5, 6]
    kept.begin("m2", (1,), SamplingParams(), 4)
    assert kept.tokens == [] and kept.model == "m2"
