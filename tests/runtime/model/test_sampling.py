"""Sampling parameters, the seeded sampler, and stop sequences."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.model.sampling import (
    MAX_STOP_SEQUENCES,
    NUCLEUS_FIRST_CANDIDATES,
    SamplingParamError,
    SamplingParams,
    StopResult,
    StopScanner,
    adjusted,
    penalized,
    sample,
    token_margin,
)

GREEDY = SamplingParams(temperature=0.0)

logit_vectors = st.lists(
    st.floats(-20, 20, allow_nan=False, width=32), min_size=1, max_size=40
).map(lambda values: np.array(values, dtype=np.float32))


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def frequencies(logits: np.ndarray, params: SamplingParams, draws: int) -> np.ndarray:
    counts = np.zeros(logits.shape[0])
    for seed in range(draws):
        counts[sample(logits, params, seed=seed, step=3)] += 1
    return counts


def chi_square(counts: np.ndarray, expected_p: np.ndarray) -> float:
    expected = expected_p * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "drew a token with probability 0"
    return float((((counts - expected) ** 2)[mask] / expected[mask]).sum())


# --- parameters -------------------------------------------------------------


def test_defaults_are_openais() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert params.seed is None and params.max_tokens is None and params.stop == ()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"stop": ["a"] * (MAX_STOP_SEQUENCES + 1)}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop": "abc"}, "stop"),
    ],
)
def test_invalid_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamError) as caught:
        SamplingParams(**fields)
    assert caught.value.param == param
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(param)


def test_from_request_reads_openai_bodies() -> None:
    params = SamplingParams.from_request(
        {"temperature": 0, "top_p": None, "seed": -7, "max_tokens": 12, "stop": "\n\n"}
    )
    assert params == SamplingParams(temperature=0.0, seed=-7, max_tokens=12, stop=("\n\n",))
    newer = SamplingParams.from_request({"max_completion_tokens": 5, "stop": ["a", "b"]})
    assert newer.max_tokens == 5 and newer.stop == ("a", "b")
    assert SamplingParams.from_request({}) == SamplingParams()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": "10"}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"stop": {"a": 1}}, "stop"),
        ({"top_k": "5"}, "top_k"),
    ],
)
def test_from_request_names_the_bad_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamError) as caught:
        SamplingParams.from_request(body)
    assert caught.value.param == param


# --- sampler ----------------------------------------------------------------


@given(logit_vectors)
def test_greedy_is_argmax_with_ties_to_the_lowest_id(logits: np.ndarray) -> None:
    token = sample(logits, GREEDY, seed=0, step=0)
    assert logits[token] == logits.max()
    assert token == int(np.flatnonzero(logits == logits.max())[0])


@given(logit_vectors, st.integers(-(2**63), 2**64 - 1), st.integers(0, 10_000))
@settings(max_examples=200)
def test_same_seed_and_step_draw_the_same_token(logits: np.ndarray, seed: int, step: int) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=5)
    first = sample(logits, params, seed=seed, step=step)
    # A fresh call elsewhere (a new last hop after failover) draws the same.
    assert sample(logits.copy(), params, seed=seed, step=step) == first
    assert 0 <= first < logits.shape[0]


def test_steps_and_seeds_vary_the_draw() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    params = SamplingParams(temperature=1.0)
    by_step = {sample(logits, params, seed=1, step=step) for step in range(50)}
    by_seed = {sample(logits, params, seed=seed, step=0) for seed in range(50)}
    assert len(by_step) > 40 and len(by_seed) > 40


@given(logit_vectors)
def test_top_k_one_and_tiny_top_p_are_greedy(logits: np.ndarray) -> None:
    greedy = sample(logits, GREEDY, seed=0, step=0)
    for params in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-9),
    ):
        assert [sample(logits, params, seed=seed, step=0) for seed in range(5)] == [greedy] * 5


# Chi-square critical values at p = 0.001 for the degrees of freedom used below;
# the seeds are fixed, so these tests are deterministic, not flaky.
CHI2_CRITICAL_3_DOF = 16.27
CHI2_CRITICAL_5_DOF = 20.52


def test_distribution_matches_the_softmax() -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    params = SamplingParams(temperature=0.7)
    counts = frequencies(logits, params, 6000)
    assert chi_square(counts, softmax(logits, 0.7)) < CHI2_CRITICAL_5_DOF


def test_top_k_renormalises_over_the_k_best() -> None:
    logits = np.array([0.0, 3.0, 1.0, 2.0, -1.0, 2.5], dtype=np.float32)
    counts = frequencies(logits, SamplingParams(temperature=1.0, top_k=4), 6000)
    expected = softmax(logits, 1.0)
    expected[[0, 4]] = 0  # the two worst are cut
    expected /= expected.sum()
    assert chi_square(counts, expected) < CHI2_CRITICAL_3_DOF


def test_top_p_keeps_the_nucleus() -> None:
    # Probabilities 0.5, 0.25, 0.125, 0.0625, ...: top_p 0.8 keeps the first
    # three (0.875 is the first cumulative mass reaching 0.8).
    probabilities = np.array([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125])
    logits = np.log(probabilities).astype(np.float32)
    counts = frequencies(logits, SamplingParams(temperature=1.0, top_p=0.8), 6000)
    expected = np.array([4, 2, 1, 0, 0, 0]) / 7
    assert chi_square(counts, expected) < CHI2_CRITICAL_3_DOF


def test_top_k_ties_at_the_cut_go_to_the_lowest_ids() -> None:
    logits = np.array([0.0, 1.0, 0.0, 0.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=3)
    assert {sample(logits, params, seed=seed, step=0) for seed in range(300)} == {0, 1, 2}


def test_nucleus_in_a_flat_vocabulary_grows_past_the_first_candidates() -> None:
    size = NUCLEUS_FIRST_CANDIDATES * 20
    logits = np.zeros(size, dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.5)
    drawn = {sample(logits, params, seed=seed, step=0) for seed in range(4000)}
    # Ties go to the lowest ids: the nucleus is exactly the first half.
    assert max(drawn) == size // 2 - 1
    assert len(drawn) > size // 2 * 0.9


def test_masked_tokens_are_never_drawn() -> None:
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
    drawn = {
        sample(logits, SamplingParams(temperature=2.0), seed=seed, step=0) for seed in range(500)
    }
    assert drawn == {1, 3}


@pytest.mark.parametrize(
    "logits",
    [
        np.array([], dtype=np.float32),
        np.zeros((2, 3), dtype=np.float32),
        np.array([0.0, np.nan], dtype=np.float32),
        np.array([0.0, np.inf], dtype=np.float32),
        np.array([-np.inf, -np.inf], dtype=np.float32),
    ],
)
def test_broken_logits_are_refused(logits: np.ndarray) -> None:
    with pytest.raises(ValueError):
        sample(logits, SamplingParams(), seed=0, step=0)


# --- stop sequences ---------------------------------------------------------


def run_scanner(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    scanner = StopScanner(stops)
    emitted = []
    stopped = False
    for piece in pieces:
        result = scanner.feed(piece)
        emitted.append(result.text)
        if result.stopped:
            stopped = True
            break
    return emitted, stopped, scanner.flush()


def test_stop_split_across_increments() -> None:
    emitted, stopped, rest = run_scanner(["END"], ["Hello E", "N", "D world"])
    assert emitted == ["Hello ", "", ""]
    assert stopped and rest == ""
    assert "".join(emitted) == "Hello "


def test_false_start_is_released() -> None:
    scanner = StopScanner(["END"])
    assert scanner.feed("an E") == StopResult("an ", False)
    assert scanner.feed("N") == StopResult("", False)
    assert scanner.feed("x") == StopResult("ENx", False)
    assert scanner.feed("EN") == StopResult("", False)
    assert scanner.flush() == "EN"  # generation ended without a stop


def test_earliest_of_several_stops_wins() -> None:
    emitted, stopped, _ = run_scanner(["world", "lo w"], ["hel", "lo world"])
    assert stopped and "".join(emitted) == "hel"


def test_after_a_stop_nothing_more_comes_out() -> None:
    scanner = StopScanner(["."])
    assert scanner.feed("Done. More") == StopResult("Done", True)
    assert scanner.stopped
    assert scanner.feed("text") == StopResult("", True)
    assert scanner.flush() == ""


def test_no_stops_passes_everything_through() -> None:
    scanner = StopScanner([])
    assert scanner.feed("abc") == StopResult("abc", False)
    assert scanner.flush() == ""


def test_empty_stop_is_refused() -> None:
    with pytest.raises(ValueError):
        StopScanner(["ok", ""])


ALPHABET = "ab\n"


@settings(max_examples=300)
@given(
    st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.text(ALPHABET, max_size=5), max_size=12),
)
def test_scanner_equals_truncating_the_whole_text(stops: list[str], pieces: list[str]) -> None:
    """Whatever the increments, the output is the text generated until a stop
    first appears, cut before that stop's earliest occurrence (generation
    ends then, so a longer stop still pending never completes); no emitted
    prefix ever contains part of a stop."""
    expected, expect_stop = "".join(pieces), False
    for count in range(1, len(pieces) + 1):
        text = "".join(pieces[:count])
        positions = [index for stop in stops if (index := text.find(stop)) >= 0]
        if positions:
            expected, expect_stop = text[: min(positions)], True
            break
    scanner = StopScanner(stops)
    out = ""
    stopped = False
    for piece in pieces:
        result = scanner.feed(piece)
        out += result.text
        # Everything emitted so far is final text: a prefix of the answer.
        assert expected.startswith(out)
        if result.stopped:
            stopped = True
            break
    if not stopped:
        out += scanner.flush()
    assert out == expected
    assert stopped == expect_stop


# --- presence and frequency penalties ----------------------------------------


def reference_penalized(
    logits: np.ndarray, presence: float, frequency: float, history: list[int]
) -> np.ndarray:
    """OpenAI's definition, written out token by token."""
    out = logits.astype(np.float64).copy()
    for token in set(history):
        count = history.count(token)
        out[token] -= presence * (count > 0) + frequency * count
    return out


@settings(max_examples=60, deadline=None)
@given(
    logit_vectors,
    st.floats(-2, 2),
    st.floats(-2, 2),
    st.lists(st.integers(0, 39), max_size=30),
)
def test_penalties_equal_openais_definition(
    logits: np.ndarray, presence: float, frequency: float, history: list[int]
) -> None:
    history = [t for t in history if t < logits.shape[0]]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    got = penalized(logits, params, history)
    np.testing.assert_allclose(got, reference_penalized(logits, presence, frequency, history))


def test_penalties_steer_the_draw_and_stay_a_function_of_the_history() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0], dtype=np.float32)
    history = [0, 0, 0]
    plain = SamplingParams(temperature=0.0)
    punished = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert sample(logits, plain, seed=1, step=3, history=history) == 0
    assert sample(logits, punished, seed=1, step=3, history=history) == 1
    assert sample(logits, punished, seed=1, step=3) == 0  # no history: no penalty
    sampled = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.3)
    draws = [sample(logits, sampled, seed=s, step=3, history=history) for s in range(50)]
    assert draws == [sample(logits, sampled, seed=s, step=3, history=history) for s in range(50)]


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -2.01, "1", True, math.nan])
def test_a_penalty_out_of_range_names_itself(name: str, value: Any) -> None:
    with pytest.raises(SamplingParamError) as caught:
        SamplingParams.from_request({name: value})
    assert caught.value.param == name


def test_penalties_are_read_from_a_request() -> None:
    params = SamplingParams.from_request({"presence_penalty": 2, "frequency_penalty": -2})
    assert (params.presence_penalty, params.frequency_penalty) == (2.0, -2.0)
    assert SamplingParams.from_request({"presence_penalty": None}).presence_penalty == 0.0


# --- the constraint's mask ------------------------------------------------------


def test_a_masked_token_is_never_drawn_and_never_explained() -> None:
    logits = np.array([5.0, 1.0, 0.5, 0.2], dtype=np.float32)
    allowed = np.array([False, True, True, False])
    params = SamplingParams(temperature=1.0)
    draws = {sample(logits, params, seed=s, step=0, allowed=allowed) for s in range(200)}
    assert draws == {1, 2}
    assert sample(logits, GREEDY, seed=0, step=0, allowed=allowed) == 1
    assert token_margin(logits, params, 0, seed=0, step=0, allowed=allowed) == math.inf
    drawn = sample(logits, params, seed=7, step=0, allowed=allowed)
    assert token_margin(logits, params, drawn, seed=7, step=0, allowed=allowed) == 0.0
    other = 3 - drawn  # the other allowed token: explained by a finite move
    assert 0 < token_margin(logits, params, other, seed=7, step=0, allowed=allowed) < math.inf


def test_a_mask_that_allows_nothing_or_does_not_fit_is_an_error() -> None:
    logits = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="masked"):
        adjusted(logits, GREEDY, allowed=np.zeros(4, dtype=bool))
    with pytest.raises(ValueError, match="mask of shape"):
        adjusted(logits, GREEDY, allowed=np.ones(3, dtype=bool))
