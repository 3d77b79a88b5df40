"""The relay core as scenarios: the line protocol refuses what it cannot
parse, the relay's book bounds reservations, waiting dials and sessions
(each refusal counted), the byte budget paces a burst, and a node behind
NAT holds two relays, replacing a lost one but not retrying it at once."""

from __future__ import annotations

import pytest

from mesh.identity import Identity, verify
from mesh.relay import (
    MAX_LINE_BYTES,
    PENDING_TIMEOUT_S,
    RETRY_S,
    Held,
    LineError,
    RelayBook,
    RelaySet,
    TokenBucket,
    encode_line,
    parse_line,
    reserve_signing_bytes,
)

NODE = bytes([1]) * 32
OTHER = bytes([2]) * 32


def line(verb: str, *fields: bytes | int | str) -> bytes:
    return encode_line(verb, *fields).removesuffix(b"\n")


def test_every_line_round_trips() -> None:
    assert parse_line(line("HELLO", bytes(16))).fields == (bytes(16),)
    assert parse_line(line("RESERVE", NODE, bytes(64))).fields == (NODE, bytes(64))
    reserved = parse_line(line("RESERVED", 7001, 7002, 7003, "10.77.3.2"))
    assert reserved.fields == (7001, 7002, 7003, "10.77.3.2")
    assert parse_line(line("CONNECT", bytes(16), "api")).fields == (bytes(16), "api")
    assert parse_line(line("CONNECT", bytes(16), "data")).fields == (bytes(16), "data")
    assert parse_line(line("ACCEPT", bytes(16))).verb == "ACCEPT"
    assert parse_line(line("PING")).verb == "PING"
    assert parse_line(line("REFUSED", "reservations_full")).fields == ("reservations_full",)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe", "garbage"),
        (b"HELLO", "garbage"),
        (b"HELLO zz", "garbage"),
        (b"HELLO " + b"00" * 15, "garbage"),
        (b"RESERVED 0 7002 7003 10.0.0.1", "garbage"),
        (b"RESERVED 7001 99999 7003 10.0.0.1", "garbage"),
        (b"RESERVED 7001 7002 7003", "garbage"),
        (b"RESERVED 7001 7002 7003 relay.example", "garbage"),
        (b"CONNECT " + b"00" * 16 + b" raft", "garbage"),
        (b"PING extra", "garbage"),
        (b"LAUNCH", "garbage"),
        (b"A" * (MAX_LINE_BYTES + 1), "oversized"),
    ],
)
def test_a_bad_line_is_refused_with_its_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(LineError) as caught:
        parse_line(raw)
    assert caught.value.reason == reason


def test_a_reservation_signs_the_relays_nonce() -> None:
    identity = Identity.generate()
    signature = identity.sign(reserve_signing_bytes(b"n" * 16))
    assert verify(identity.node_id, reserve_signing_bytes(b"n" * 16), signature)
    assert not verify(identity.node_id, reserve_signing_bytes(b"m" * 16), signature)


def test_the_book_bounds_reservations_and_a_node_that_reconnects_keeps_its_place() -> None:
    book = RelayBook(max_reservations=1)
    assert book.reserve(NODE, 0.0) is None
    assert book.reserve(NODE, 1.0) is None, "the same node again replaces its reservation"
    assert book.reserve(OTHER, 1.0) == "reservations_full"
    book.release(NODE)
    assert book.reserve(OTHER, 2.0) is None
    assert book.counters["refused_reservations_full"] == 1


def test_a_dial_waits_for_its_node_and_a_token_is_good_once() -> None:
    book = RelayBook()
    assert book.dialed(NODE, "control", b"t" * 16, 0.0) == "unknown_token", "no reservation"
    book.reserve(NODE, 0.0)
    assert book.dialed(NODE, "control", b"t" * 16, 0.0) is None
    assert book.accepted(b"t" * 16, 1.0) == (NODE, "control")
    assert book.accepted(b"t" * 16, 1.0) is None, "a token is spent"
    assert book.status()["sessions"] == 1
    book.ended()
    assert book.status()["sessions"] == 0
    book.dialed(NODE, "data", b"u" * 16, 10.0)
    assert book.accepted(b"u" * 16, 10.0 + PENDING_TIMEOUT_S + 0.1) is None, "too late"
    assert book.counters["refused_unknown_token"] == 3


def test_waiting_dials_and_sessions_are_bounded() -> None:
    book = RelayBook(max_pending=2, max_sessions=3)
    book.reserve(NODE, 0.0)
    book.reserve(OTHER, 0.0)
    assert book.dialed(NODE, "control", b"a" * 16, 0.0) is None
    assert book.dialed(NODE, "data", b"b" * 16, 0.0) is None
    assert book.dialed(NODE, "data", b"c" * 16, 0.0) == "pending_full"
    assert book.dialed(OTHER, "data", b"d" * 16, 0.0) is None
    assert book.dialed(OTHER, "data", b"e" * 16, 0.0) == "sessions_full"
    book.abandon(b"a" * 16)
    assert book.counters["refused_no_answer"] == 1
    book.release(NODE)
    assert book.status()["pending"] == 1, "a released node's dials go with it"


def test_the_byte_budget_lets_a_burst_through_then_paces_at_its_rate() -> None:
    bucket = TokenBucket(rate=1000.0, burst=500.0)
    assert bucket.delay(500, 0.0) == 0.0
    assert bucket.delay(250, 0.0) == pytest.approx(0.25)
    assert bucket.delay(0, 10.0) == 0.0, "refilled, never above the burst"
    assert bucket.delay(500, 10.0) == 0.0


def test_a_node_holds_two_relays_seeds_first_and_replaces_a_lost_one_later() -> None:
    relays = RelaySet()
    offered = {b"seed": "tcp://s:7101", b"m1": "tcp://m1:7101", b"m2": "tcp://m2:7101"}
    assert relays.to_try(offered, 0.0) == [(b"seed", "tcp://s:7101"), (b"m1", "tcp://m1:7101")]
    assert relays.to_try(offered, 0.0) == [], "both being tried"
    relays.reserved(Held(b"m1", "tcp://m1:1", "tcp://m1:2", "http://m1:3"))
    relays.reserved(Held(b"seed", "tcp://s:1", "tcp://s:2", "http://s:3"))
    assert relays.advertised == Held(b"m1", "tcp://m1:1", "tcp://m1:2", "http://m1:3")
    relays.lost(b"m1", 5.0)
    assert relays.advertised is not None and relays.advertised.relay == b"seed"
    assert relays.to_try(offered, 5.0) == [(b"m2", "tcp://m2:7101")], "not m1 again so soon"
    relays.lost(b"m2", 6.0)
    assert relays.to_try(offered, 6.0 + RETRY_S) == [(b"m1", "tcp://m1:7101")]
