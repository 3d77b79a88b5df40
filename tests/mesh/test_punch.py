"""The direct-path core: what a punch request may say, whom to punch and
when again, and how many punches a node answers."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.punch import (
    MAX_ANSWERING,
    RETRY_S,
    SOON_RETRY_S,
    DirectPaths,
    PunchBudget,
    PunchError,
    PunchRequest,
    meeting_point,
    method_for,
)

C, D, E = b"c" * 32, b"d" * 32, b"e" * 32


def test_a_request_round_trips_and_names_an_ip_never_a_name() -> None:
    request = PunchRequest("data", "simultaneous", "10.77.3.2", 45000)
    assert PunchRequest.from_json(request.to_json()) == request
    assert (
        PunchRequest.from_json({**request.to_json(), "host": "2001:db8::1"}).host == "2001:db8::1"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"plane": "api"},
        {"method": "guess"},
        {"host": "relay.example"},
        {"host": "0.0.0.0"},
        {"host": "224.0.0.1"},
        {"host": "127.0.0.1"},  # the node's own machine: its services spliced into a plane
        {"host": "::1"},
        {"host": "169.254.1.1"},
        {"host": 7},
        {"port": 0},
        {"port": 65536},
        {"port": "45000"},
        {"port": True},
    ],
)
def test_a_bad_request_is_refused_saying_what(change: dict[str, Any]) -> None:
    body = {"plane": "data", "method": "reverse", "host": "10.0.0.1", "port": 1, **change}
    with pytest.raises(PunchError, match=next(iter(change))):
        PunchRequest.from_json(body)


@pytest.mark.parametrize("answer", [[1, 2], "10.0.0.1:4500", None])
def test_an_answer_that_is_no_json_object_is_refused(answer: object) -> None:
    with pytest.raises(PunchError, match="JSON object"):
        meeting_point(answer)


def test_a_reachable_node_is_dialed_and_two_behind_nat_dial_at_once() -> None:
    assert method_for(reachable=True) == "reverse"
    assert method_for(reachable=False) == "simultaneous"


def test_punches_are_bounded_and_a_nat_that_refused_waits_longer_than_a_silent_peer() -> None:
    paths = DirectPaths(max_trying=2)
    wanted = [(C, "data"), (D, "data"), (E, "data")]
    assert paths.to_try(wanted, 0.0) == [(C, "data"), (D, "data")], "two at once"
    assert paths.to_try(wanted, 0.0) == [], "both still trying"
    paths.failed((C, "data"), "timeout", 1.0)  # the NATs let nothing through
    paths.failed((D, "data"), "no_answer", 1.0)  # the peer never answered
    assert paths.to_try(wanted, 1.0) == [(E, "data")]
    paths.succeeded((E, "data"), "simultaneous")
    assert paths.to_try(wanted, 1.0 + SOON_RETRY_S) == [(D, "data")]
    paths.failed((D, "data"), "refused", 1.0 + SOON_RETRY_S)
    assert paths.to_try(wanted, SOON_RETRY_S * 2) == [], "C waits longer, D a little"
    assert paths.to_try(wanted, 1.0 + RETRY_S) == [(C, "data"), (D, "data")]
    assert paths.direct() == [(E, "data")]
    assert paths.counters["direct_simultaneous"] == 1 and paths.counters["failed_timeout"] == 1


def test_a_path_that_closes_is_punched_again_soon_and_a_peer_gone_is_forgotten() -> None:
    paths = DirectPaths()
    assert paths.to_try([(C, "control")], 0.0) == [(C, "control")]
    paths.succeeded((C, "control"), "reverse")
    assert paths.to_try([(C, "control")], 100.0) == [], "direct: nothing to do"
    paths.lost((C, "control"), 100.0)
    assert paths.state((C, "control")) == "lost"
    assert paths.to_try([(C, "control")], 100.0 + SOON_RETRY_S) == [(C, "control")]
    paths.forget(keep=[D])
    assert paths.state((C, "control")) is None


def test_the_book_holds_at_most_max_paths() -> None:
    paths = DirectPaths(max_paths=2, max_trying=10)
    assert len(paths.to_try([(C, "data"), (D, "data"), (E, "data")], 0.0)) == 2


def test_a_node_answers_one_punch_per_requester_and_plane_at_a_time_and_few_in_all() -> None:
    budget = PunchBudget()
    assert budget.admit(C, "data", 0.0) is None
    assert budget.admit(C, "data", 1.0) == "too_often"
    assert budget.admit(C, "control", 1.0) is None, "another plane"
    budget.done(connected=True)
    budget.done(connected=False)
    assert budget.admit(C, "data", 5.0) is None, "after the interval"
    busy = PunchBudget(max_answering=1)
    assert busy.admit(C, "data", 0.0) is None
    assert busy.admit(D, "data", 0.0) == "busy"
    assert budget.counters["answered_direct"] == budget.counters["answered_failed"] == 1
    assert busy.counters["refused_busy"] == 1 and MAX_ANSWERING > 1
