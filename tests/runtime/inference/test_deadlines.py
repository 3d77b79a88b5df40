"""Step deadlines from the hops' measured speed, and which hop held up a late step."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.routes import MIN_DECODE_TOKENS_PER_S
from runtime.inference.batcher import MAX_BATCH_ROWS
from runtime.inference.deadlines import (
    BATCHED_STEP_STRETCH,
    CHUNKED_PREFILL_STRETCH,
    DEADLINE_CEILING_S,
    DEADLINE_FACTOR,
    DEADLINE_FLOOR_S,
    DEFAULT_DEADLINES,
    UNMEASURED_PACE,
    Deadlines,
    HopPace,
    expected_pace,
    find_stall,
)

NODES = ["a" * 64, "b" * 64, "c" * 64]

paces = st.builds(
    HopPace,
    prefill_s_per_token=st.floats(0, 1, allow_nan=False),
    decode_step_s=st.floats(0, 5, allow_nan=False),
)


# --- the rule -----------------------------------------------------------------------


def test_a_prefill_is_its_tokens_plus_what_any_step_costs() -> None:
    pace = HopPace(prefill_s_per_token=0.02, decode_step_s=0.05)
    assert pace.step_s(512, prefill=True) == pytest.approx(512 * 0.02 + 0.05)
    assert pace.step_s(1, prefill=False) == 0.05
    slowed = pace.slowed(3.0)
    assert (slowed.prefill_s_per_token, slowed.decode_step_s) == pytest.approx((0.06, 0.15))


def test_the_issue_15_hop_gets_the_time_its_doctor_measured() -> None:
    """An MLX hop on a CPU prefills ~20 tokens a second (42 tokens in 1.3 to
    2.4 s): the fixed rule gave a 512-token prompt 2 + 512 * 0.005 = 4.56 s
    through the whole chain; the measured rule gives it four times what it
    needs, on top of the floor."""
    mlx = expected_pace(claimed_prefill_tokens_per_s=20.0, claimed_decode_tokens_per_s=5.0)
    gpu = expected_pace(claimed_prefill_tokens_per_s=5000.0, claimed_decode_tokens_per_s=100.0)
    chain = [gpu, mlx, gpu]
    expected = [pace.step_s(512, prefill=True) for pace in chain]
    assert sum(expected) > 512 / 20  # the slow hop alone needs 25.6 s
    deadline = DEFAULT_DEADLINES.step_s(expected)
    assert deadline == pytest.approx(DEADLINE_FLOOR_S + DEADLINE_FACTOR * sum(expected))
    assert deadline > 100 > 2 + 512 * 0.005
    # A decode step of a fast chain is given about what the fixed 2 s gave,
    # though each hop may be running a full batch.
    fast = [gpu.step_s(1, prefill=False)] * 3
    assert DEFAULT_DEADLINES.step_s(fast) == pytest.approx(DEADLINE_FLOOR_S + 4 * 3 * 0.04)


@settings(max_examples=200, deadline=None)
@given(
    chain=st.lists(paces, min_size=1, max_size=8),
    tokens=st.integers(1, 100_000),
    more=st.integers(1, 10_000),
    prefill=st.booleans(),
)
def test_a_deadline_lies_between_floor_and_ceiling_and_grows_with_the_work(
    chain: list[HopPace], tokens: int, more: int, prefill: bool
) -> None:
    expected = [pace.step_s(tokens, prefill=prefill) for pace in chain]
    deadline = DEFAULT_DEADLINES.step_s(expected)
    assert DEADLINE_FLOOR_S <= deadline <= DEADLINE_CEILING_S
    if deadline < DEADLINE_CEILING_S:  # below the cap: the factor times the work, and the floor
        assert deadline == pytest.approx(DEADLINE_FLOOR_S + DEADLINE_FACTOR * sum(expected))
    longer = [pace.step_s(tokens + more, prefill=prefill) for pace in chain]
    assert DEFAULT_DEADLINES.step_s(longer) >= deadline
    slower = [pace.slowed(2.0).step_s(tokens, prefill=prefill) for pace in chain]
    assert DEFAULT_DEADLINES.step_s(slower) >= deadline


def test_what_a_node_is_expected_to_take() -> None:
    # Observed figures win over the claim...
    pace = expected_pace(
        claimed_prefill_tokens_per_s=1000.0,
        claimed_decode_tokens_per_s=100.0,
        observed_prefill_s_per_token=0.004,
        observed_step_s=0.03,
    )
    assert pace == HopPace(0.004, 0.03)
    # ...and the claim stands in for what was not observed: a lone step's,
    # stretched for a batch the hop may be running.
    pace = expected_pace(claimed_prefill_tokens_per_s=1000.0, claimed_decode_tokens_per_s=100.0)
    assert (pace.prefill_s_per_token, pace.decode_step_s) == pytest.approx(
        (0.001 * CHUNKED_PREFILL_STRETCH, 0.01 * BATCHED_STEP_STRETCH)
    )
    # A rate of 0 is a missing measurement: decode as slow as routes price
    # it, prefill no slower than its tokens one lone decode step at a time.
    pace = expected_pace(claimed_prefill_tokens_per_s=0.0, claimed_decode_tokens_per_s=0.0)
    slowest = 1 / MIN_DECODE_TOKENS_PER_S
    assert pace == HopPace(slowest, slowest * BATCHED_STEP_STRETCH)
    pace = expected_pace(
        claimed_prefill_tokens_per_s=0.0, claimed_decode_tokens_per_s=50.0, observed_step_s=0.1
    )
    assert pace == HopPace(0.1, 0.1)
    # No report at all.
    none = expected_pace(claimed_prefill_tokens_per_s=None, claimed_decode_tokens_per_s=None)
    assert none == UNMEASURED_PACE


def test_a_claim_of_a_few_tokens_a_second_cannot_hold_a_step_for_ever() -> None:
    crawl = expected_pace(claimed_prefill_tokens_per_s=1e-9, claimed_decode_tokens_per_s=1e-9)
    expected = [crawl.step_s(100_000, prefill=True)]
    assert DEFAULT_DEADLINES.step_s(expected) == DEADLINE_CEILING_S


def test_malformed_rules_and_paces_are_refused() -> None:
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            HopPace(bad, 0.1)
        with pytest.raises(ValueError):
            HopPace(0.1, bad)
    with pytest.raises(ValueError):
        Deadlines(open_s=0)
    with pytest.raises(ValueError):
        Deadlines(floor_s=0)
    with pytest.raises(ValueError):
        Deadlines(floor_s=10, ceiling_s=5)
    with pytest.raises(ValueError):
        Deadlines(factor=0.5)


# --- which hop held the step up ---------------------------------------------------------------


def test_the_first_hop_that_has_not_reported_holds_the_step() -> None:
    # Sent at 0; hop 0 reported at 0.1 (expected 0.1); at 4.0 hop 1 is still silent.
    stall = find_stall(NODES, [0.1, 0.2, 0.1], 0.0, [0.1, None, None], 4.0)
    assert (stall.index, stall.node, stall.silent) == (1, NODES[1], True)
    assert stall.held_s == pytest.approx(3.9)
    assert stall.slowdown == pytest.approx(3.9 / 0.2)


def test_a_hop_that_reported_late_is_blamed_over_one_still_on_time() -> None:
    """Hop 0 took 3 s for an expected 0.1 s; hop 1 has been computing for
    0.5 s of its expected 1 s when the deadline passes: hop 0 held the step."""
    stall = find_stall(NODES, [0.1, 1.0, 0.1], 0.0, [3.0, None, None], 3.5)
    assert (stall.index, stall.silent) == (0, False)
    assert stall.held_s == pytest.approx(3.0)


def test_nobody_reported_means_the_first_hop_holds_it() -> None:
    stall = find_stall(NODES, [0.1, 0.1, 0.1], 5.0, [None, None, None], 7.0)
    assert (stall.index, stall.silent, stall.held_s) == (0, True, pytest.approx(2.0))


def test_a_lost_report_merges_its_hop_into_the_next() -> None:
    # Hop 0's commitment never came, hop 1's did: hop 1 is charged from the send.
    stall = find_stall(NODES, [0.1, 0.1, 10.0], 0.0, [None, 2.0, None], 2.5)
    assert (stall.index, stall.held_s, stall.silent) == (1, pytest.approx(2.0), False)


def test_with_every_report_in_the_slowest_for_its_expectation_is_blamed() -> None:
    stall = find_stall(NODES, [1.0, 0.01, 1.0], 0.0, [1.0, 1.5, 2.5], 3.0)
    assert (stall.index, stall.silent) == (1, False)


def test_stall_needs_one_slot_per_hop() -> None:
    with pytest.raises(ValueError):
        find_stall(NODES, [0.1], 0.0, [None, None, None], 1.0)
    with pytest.raises(ValueError):
        find_stall([], [], 0.0, [], 1.0)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    hops=st.integers(1, 8),
    sent_at=st.floats(0, 1e4, allow_nan=False),
)
def test_the_stall_is_the_hop_that_held_the_step_the_most_times_its_expectation(
    data: st.DataObject, hops: int, sent_at: float
) -> None:
    """Reports arrive in chain order up to some hop; whatever the times, the
    stall is at or before the first silent hop, held the step no longer than
    it has been out, and no reporting hop held it more times its expected
    time than the stall did."""
    expected = data.draw(st.lists(st.floats(1e-6, 100), min_size=hops, max_size=hops))
    gaps = data.draw(st.lists(st.floats(0, 100), min_size=hops, max_size=hops))
    reporting = data.draw(st.integers(0, hops - 1))  # the last hop's report is the token
    reported: list[float | None] = []
    at = sent_at
    for i in range(hops):
        at += gaps[i]
        reported.append(at if i < reporting else None)
    now = at + data.draw(st.floats(0, 100))
    stall = find_stall(NODES[:1] * hops, expected, sent_at, reported, now)
    assert stall.index <= reporting
    assert stall.silent == (stall.index == reporting)
    assert 0 <= stall.held_s <= now - sent_at + 1e-9
    start = sent_at
    for i in range(reporting):
        report = reported[i]
        assert report is not None
        assert (report - start) / expected[i] <= stall.slowdown * (1 + 1e-9)
        start = report
    assert (now - start) / expected[reporting] <= stall.slowdown * (1 + 1e-9)


def test_a_claimed_step_allows_for_a_full_batch_an_observed_one_is_as_seen() -> None:
    """A doctor times a lone step; a loaded hop runs up to MAX_BATCH_ROWS
    sessions' steps as one forward, each taking the batch's time (measured
    3-4x a lone step on a CPU at 16 rows): a step on such a hop is expected
    that much slower, so a loaded hop is not taken for a slow one. What the
    entry observed already holds the batches the hop ran."""
    assert MAX_BATCH_ROWS > 1 and 1 < BATCHED_STEP_STRETCH <= MAX_BATCH_ROWS
    lone = 1 / 50.0
    claimed = expected_pace(claimed_prefill_tokens_per_s=500.0, claimed_decode_tokens_per_s=50.0)
    batch = lone * BATCHED_STEP_STRETCH
    assert claimed.decode_step_s == pytest.approx(batch)
    # A step of a full batch, behind another one, is within the deadline.
    deadline = DEFAULT_DEADLINES.step_s([claimed.step_s(1, prefill=False)])
    assert deadline > DEADLINE_FLOOR_S + 2 * batch
    observed = expected_pace(
        claimed_prefill_tokens_per_s=500.0, claimed_decode_tokens_per_s=50.0, observed_step_s=0.03
    )
    assert observed.decode_step_s == 0.03
