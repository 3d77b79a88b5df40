"""The reachability core as scenarios: who is asked, what the answers make
of the verdict, and when it is checked again."""

from __future__ import annotations

import random

import pytest

from mesh.reachability import (
    ANSWER_TTL_S,
    ANSWER_WAIT_S,
    MAX_ANSWERS,
    MIN_ASK_INTERVAL_S,
    PROBERS,
    RECHECK_S,
    RETRY_S,
    SERVE_INTERVAL_S,
    Ask,
    Reachability,
    RequestLimit,
)

MEMBERS = [bytes([i]) * 32 for i in range(1, 8)]
ADDR = "tcp://10.77.1.2:7001"


def checker(address: str | None = ADDR) -> Reachability:
    core = Reachability(random.Random(7))
    if address is not None:
        core.set_address(address)
    return core


def ask_round(core: Reachability, now: float, members: list[bytes] = MEMBERS) -> list[Ask]:
    core.tick(now, members)
    asks = core.take_asks()
    for ask in asks:
        core.taken(ask.prober)
    return asks


def test_a_node_asks_a_few_distinct_members_and_never_itself_twice() -> None:
    core = checker()
    asks = ask_round(core, 0.0)
    assert len(asks) == PROBERS
    assert len({a.prober for a in asks}) == PROBERS
    assert all(a.prober in MEMBERS for a in asks)
    assert len({a.nonce for a in asks}) == PROBERS
    assert core.verdict() == "unknown"
    core.tick(1.0, MEMBERS)
    assert core.take_asks() == []  # three in flight: nobody else is asked


def test_nothing_is_asked_before_the_node_knows_its_address() -> None:
    core = checker(address=None)
    core.tick(0.0, MEMBERS)
    assert core.take_asks() == []


def test_dial_backs_from_two_probers_make_it_direct() -> None:
    core = checker()
    first, second, _ = ask_round(core, 0.0)
    assert core.dialed_back(first.prober, first.nonce, 0.2)
    assert core.verdict() == "unknown"  # one answer is not enough among many members
    assert core.dialed_back(second.prober, second.nonce, 0.3)
    assert core.verdict() == "direct"


def test_a_dial_back_with_another_nonce_or_from_someone_unasked_counts_for_nothing() -> None:
    core = checker()
    first, second = ask_round(core, 0.0, MEMBERS[:2])
    assert not core.dialed_back(first.prober, second.nonce, 0.1)
    assert not core.dialed_back(MEMBERS[5], first.nonce, 0.1)  # never asked
    assert core.answers() == {"ok": 0, "failed": 0, "pending": 2}
    assert core.dialed_back(first.prober, first.nonce, 0.2)
    assert not core.dialed_back(first.prober, first.nonce, 0.3)  # a replay: already answered
    assert core.answers() == {"ok": 1, "failed": 0, "pending": 1}


def test_silence_after_a_taken_request_is_failed_and_makes_it_unreachable() -> None:
    core = checker()
    ask_round(core, 0.0)
    core.tick(ANSWER_WAIT_S - 0.1, MEMBERS)
    assert core.verdict() == "unknown"
    core.tick(ANSWER_WAIT_S, MEMBERS)
    assert core.answers()["failed"] == PROBERS
    assert core.verdict() == "unreachable"


def test_a_prober_we_could_not_reach_is_no_evidence() -> None:
    core = checker()
    core.tick(0.0, MEMBERS)
    for ask in core.take_asks():
        core.unreachable_prober(ask.prober)  # never taken
    core.tick(ANSWER_WAIT_S + 1, MEMBERS)
    assert core.answers() == {"ok": 0, "failed": 0, "pending": PROBERS}  # a new round
    assert core.verdict() == "unknown"


def test_a_silent_request_that_was_never_taken_is_not_a_failure() -> None:
    core = checker()
    core.tick(0.0, MEMBERS)
    core.take_asks()  # the driver never confirmed delivery
    core.tick(ANSWER_WAIT_S, MEMBERS)
    assert core.answers()["failed"] == 0


def test_in_a_two_node_swarm_the_one_peer_decides() -> None:
    core = checker()
    (only,) = ask_round(core, 0.0, MEMBERS[:1])
    assert core.dialed_back(only.prober, only.nonce, 0.1)
    assert core.verdict() == "direct"


def test_members_joining_between_rounds_do_not_undo_a_verdict() -> None:
    core = checker()
    (only,) = ask_round(core, 0.0, MEMBERS[:1])
    core.dialed_back(only.prober, only.nonce, 0.1)
    core.tick(1.0, MEMBERS)  # six more members, heard of before the next round
    assert core.verdict() == "direct"


def test_a_lone_node_behind_nat_learns_it_from_its_seed() -> None:
    core = checker()
    ask_round(core, 0.0, MEMBERS[:1])
    core.tick(ANSWER_WAIT_S, MEMBERS[:1])
    assert core.verdict() == "unreachable"


def test_split_answers_give_no_verdict() -> None:
    core = checker()
    first, _ = ask_round(core, 0.0, MEMBERS[:2])
    core.dialed_back(first.prober, first.nonce, 0.1)
    core.tick(ANSWER_WAIT_S, MEMBERS[:2])
    assert core.answers() == {"ok": 1, "failed": 1, "pending": 0}
    assert core.verdict() == "unknown"


def test_an_address_change_forgets_the_answers_and_asks_again_at_once() -> None:
    core = checker()
    asks = ask_round(core, 0.0, MEMBERS[:3])
    for ask in asks:
        core.dialed_back(ask.prober, ask.nonce, 0.1)
    assert core.verdict() == "direct"
    core.set_address("tcp://10.77.9.2:7001")
    assert core.verdict() == "unknown"
    later = MIN_ASK_INTERVAL_S  # the same probers may be asked once their spacing is over
    assert len(ask_round(core, later, MEMBERS[:3])) == 3


def test_a_verdict_is_rechecked_periodically_and_holds_meanwhile() -> None:
    core = checker()
    for ask in ask_round(core, 0.0):
        core.dialed_back(ask.prober, ask.nonce, 0.1)
    assert ask_round(core, RECHECK_S - 1) == []
    again = ask_round(core, RECHECK_S)
    assert len(again) == PROBERS
    assert core.verdict() == "direct"  # the old answers stand until they expire
    core.tick(ANSWER_TTL_S + 0.1, MEMBERS)
    assert core.answers()["ok"] == 0
    assert core.verdict() in {"unknown", "unreachable"}


def test_without_a_verdict_a_new_round_starts_soon() -> None:
    core = checker()
    core.tick(0.0, MEMBERS[:1])
    (ask,) = core.take_asks()
    core.unreachable_prober(ask.prober)
    assert ask_round(core, RETRY_S, MEMBERS[:1]) == []  # that prober's spacing holds
    assert len(ask_round(core, MIN_ASK_INTERVAL_S, MEMBERS[:1])) == 1


def test_state_stays_bounded_over_many_rounds() -> None:
    core = checker()
    crowd = [i.to_bytes(32, "big") for i in range(500)]
    now = 0.0
    for _ in range(200):
        for ask in ask_round(core, now, crowd):
            core.dialed_back(ask.prober, ask.nonce, now)
        now += RECHECK_S
    assert sum(core.answers().values()) <= MAX_ANSWERS
    assert len(core._asked_at) <= 4 * MAX_ANSWERS


@pytest.mark.parametrize("gap", [0.0, SERVE_INTERVAL_S - 0.01])
def test_a_prober_serves_one_requester_at_a_bounded_rate(gap: float) -> None:
    limit = RequestLimit()
    assert limit.allow(MEMBERS[0], 100.0)
    assert not limit.allow(MEMBERS[0], 100.0 + gap)
    assert limit.allow(MEMBERS[1], 100.0 + gap)  # per requester
    assert limit.allow(MEMBERS[0], 100.0 + SERVE_INTERVAL_S)


def test_the_prober_limit_forgets_the_oldest_beyond_its_bound() -> None:
    limit = RequestLimit(max_requesters=2)
    for member in MEMBERS[:3]:
        assert limit.allow(member, 0.0)
    assert limit.allow(MEMBERS[0], 0.1)  # evicted, so allowed again
    assert not limit.allow(MEMBERS[2], 0.1)
