"""The ZAP handler and the handshake gate (`mesh.zap`), without planes: the
gate's budget and memory of admitted keys, and the handler's answer to each
kind of RFC 27 request. The same over real handshakes is in
test_transport.py."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import zmq

from mesh.newcomers import R_ADDRESS, R_PREFIX, NewcomerLimit
from mesh.zap import MAX_KNOWN_KEYS, R_REFUSED, HandshakeGate, ZapHandler


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_a_gate_charges_only_keys_it_does_not_know() -> None:
    gate = HandshakeGate(NewcomerLimit(1, 2), clock=FakeClock())
    assert gate.admit(key(1), "10.0.0.1") is None
    assert gate.admit(key(1), "10.0.0.1") is None  # known: not charged again
    assert gate.admit(key(2), "10.0.0.1") == R_ADDRESS
    assert gate.admit(key(3), "10.0.0.2") is None
    assert gate.admit(key(4), "10.0.0.3") == R_PREFIX
    assert gate.admit(key(1), "10.9.9.9") is None  # a known key from anywhere


def test_a_vouched_key_is_let_in_and_a_refused_key_gets_in_once_the_budget_refills() -> None:
    clock = FakeClock()
    gate = HandshakeGate(NewcomerLimit(1, 1), clock=clock)
    gate.vouch(key(9))
    assert gate.admit(key(9), "10.0.0.1") is None
    assert gate.admit(key(1), "10.0.0.1") is None  # vouching took no budget
    assert gate.admit(key(2), "10.0.0.1") == R_ADDRESS
    clock.now += 60.0
    assert gate.admit(key(2), "10.0.0.1") is None


def test_a_key_speaks_as_the_first_id_that_proved_it() -> None:
    gate = HandshakeGate(NewcomerLimit(1, 1), clock=FakeClock())
    node, twin = b"\x01" * 32, b"\x01" * 31 + b"\x81"
    gate.vouch(key(1))  # a vouch (gossip) binds no id
    assert gate.claim(key(1), twin) and gate.claim(key(1), twin)
    assert not gate.claim(key(1), node), "its twin proved the key first"
    assert gate.admit(key(2), "10.0.0.1") is None
    assert gate.claim(key(2), node), "another key is another id"


def test_a_gate_remembers_a_bounded_number_of_keys() -> None:
    gate = HandshakeGate(NewcomerLimit(1, 1), clock=FakeClock())
    for n in range(MAX_KNOWN_KEYS + 1):
        gate.vouch(key(n))
    assert gate.admit(key(MAX_KNOWN_KEYS), "10.0.0.1") is None
    # The first key vouched for was forgotten: it is a newcomer again and
    # spends the address's budget, which a known key did not.
    assert gate.admit(key(0), "10.0.0.1") is None
    assert gate.admit(key(MAX_KNOWN_KEYS + 1), "10.0.0.1") == R_ADDRESS


@pytest.fixture
def handler() -> Iterator[ZapHandler]:
    """A handler on a context of its own, domain b"d" admitting keys 1 and 2."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    zap = ZapHandler.register(context, b"d", lambda k: k in (key(1), key(2)))
    try:
        yield zap
    finally:
        zap.unregister(b"d")
        context.term()


def request(domain: bytes, client: bytes, *, mechanism: bytes = b"CURVE") -> list[bytes]:
    return [b"1.0", b"7", domain, b"10.0.0.1", b"", mechanism, client]


def test_an_admitted_key_is_answered_ok_with_its_hex_as_user_id(handler: ZapHandler) -> None:
    assert handler._answer(request(b"d", key(1))) == [
        b"1.0",
        b"7",
        b"200",
        b"OK",
        key(1).hex().encode(),
        b"",
    ]
    assert handler.take_refused(b"d") == Counter()


@pytest.mark.parametrize(
    "bad",
    [
        request(b"d", key(3)),  # the policy says no
        request(b"other", key(1)),  # a domain nobody registered
        request(b"d", key(1), mechanism=b"PLAIN"),
        request(b"d", key(1)[:31]),
        request(b"d", b"")[:6],  # CURVE without credentials
    ],
)
def test_every_other_request_is_refused_and_counted(handler: ZapHandler, bad: list[bytes]) -> None:
    assert handler._answer(bad) == [b"1.0", b"7", b"400", b"not admitted", b"", b""]
    domain = bad[2]
    assert handler.take_refused(domain) == Counter({R_REFUSED: 1})
    assert handler.take_refused(domain) == Counter()  # taken


def test_a_malformed_request_is_denied(handler: ZapHandler) -> None:
    assert handler._answer([b"1.0", b"7"]) == [
        b"1.0",
        b"",
        b"400",
        b"malformed request",
        b"",
        b"",
    ]


def test_the_gate_counts_by_its_own_reason_after_the_policy(handler: ZapHandler) -> None:
    handler.set_gate(b"d", HandshakeGate(NewcomerLimit(1, 5), clock=FakeClock()))
    assert handler._answer(request(b"d", key(1)))[2] == b"200"
    assert handler._answer(request(b"d", key(2)))[2] == b"400"  # same address, no budget
    assert handler._answer(request(b"d", key(3)))[2] == b"400"  # the policy refuses first
    assert handler.take_refused(b"d") == Counter({R_ADDRESS: 1, R_REFUSED: 1})
    handler.set_gate(b"d", None)
    assert handler._answer(request(b"d", key(2)))[2] == b"200"


def test_a_policy_can_change_and_a_raising_one_refuses(handler: ZapHandler) -> None:
    handler.set_policy(b"d", lambda k: k == key(3))
    assert handler._answer(request(b"d", key(3)))[2] == b"200"
    assert handler._answer(request(b"d", key(1)))[2] == b"400"

    def buggy(k: bytes) -> bool:
        raise RuntimeError("a bug in the policy")

    handler.set_policy(b"d", buggy)
    assert handler._answer(request(b"d", key(3)))[2] == b"400"
    handler.set_policy(b"unknown", lambda k: True)  # ignored: not registered
    assert handler._answer(request(b"unknown", key(3)))[2] == b"400"


def test_one_handler_per_context_and_one_registration_per_domain() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        first = ZapHandler.register(context, b"control", lambda k: True)
        second = ZapHandler.register(context, b"data", lambda k: True)
        assert first is second
        with pytest.raises(ValueError, match="already registered"):
            ZapHandler.register(context, b"control", lambda k: False)
        first.unregister(b"control")
        first.unregister(b"data")  # the last one out stops the thread ...
        assert not first._thread.is_alive()
        again = ZapHandler.register(context, b"control", lambda k: True)  # ... and unbinds
        assert again is not first
        again.unregister(b"control")
    finally:
        context.term()


def test_the_gate_is_safe_to_share_between_threads() -> None:
    """The ZAP thread admits while the node's thread vouches: under
    contention exactly the budget of new keys gets in."""
    gate = HandshakeGate(NewcomerLimit(50, 50), clock=FakeClock())
    admitted: list[bytes] = []
    lock = threading.Lock()

    def hammer(worker: int) -> None:
        for i in range(500):
            key = worker.to_bytes(2, "big") + i.to_bytes(30, "big")
            if gate.admit(key, "192.0.2.1") is None:
                with lock:
                    admitted.append(key)
            gate.vouch(b"v" * 31 + bytes([i % 256]))

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 50
    assert all(gate.admit(key, "192.0.2.1") is None for key in admitted)  # known now
