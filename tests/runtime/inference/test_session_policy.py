"""The session policy alone: who is admitted, refused or displaced when a hop runs short."""

from __future__ import annotations

from runtime.inference.session_policy import (
    MAX_PREFIX_SHARE,
    MAX_SESSION_SHARE,
    PENDING_GRACE_S,
    Admit,
    Holder,
    Refuse,
    SessionLimits,
    Slot,
    Standing,
)

LIMITS = SessionLimits(max_sessions=4)
GRACE = PENDING_GRACE_S


def stranger(n: int, prefix: str | None = None) -> Holder:
    return Holder(bytes([n]) * 32, prefix or f"10.0.{n}.0/24", standing=False)


def member(n: int, prefix: str | None = None) -> Holder:
    return Holder(bytes([n]) * 32, prefix or f"10.0.{n}.0/24", standing=True)


def slot(name: str, holder: Holder, opened_at: float = 0.0, *, started: bool = False) -> Slot:
    return Slot(name, holder, opened_at, started, last_used=opened_at)


def test_the_shares_are_below_one() -> None:
    assert 0 < MAX_SESSION_SHARE < 1 and 0 < MAX_PREFIX_SHARE < 1
    assert (LIMITS.key_share, LIMITS.prefix_share) == (2, 3)
    assert SessionLimits(1).key_share == SessionLimits(1).prefix_share == 1


def test_a_free_slot_is_taken_and_leaving_refuses_everyone() -> None:
    assert LIMITS.decide(stranger(1), [], 0.0) == Admit()
    refused = LIMITS.decide(member(1), [], 0.0, leaving=True)
    assert isinstance(refused, Refuse) and "leaving" in refused.reason


def test_one_key_holds_at_most_its_share() -> None:
    mallory = stranger(1)
    held = [slot("a", mallory), slot("b", mallory)]
    refused = LIMITS.decide(mallory, held, 0.0)
    assert isinstance(refused, Refuse) and "peer holds its share (2)" in refused.reason
    refused = LIMITS.decide(Holder(mallory.peer, mallory.prefix, True), held, 0.0)
    assert isinstance(refused, Refuse), "standing does not lift the key share"


def test_one_network_of_strangers_holds_at_most_its_share() -> None:
    net = "10.9.9.0/24"
    held = [slot(str(n), stranger(n, net)) for n in range(3)]
    refused = LIMITS.decide(stranger(7, net), held, 0.0)
    assert isinstance(refused, Refuse) and f"network ({net}) holds its share (3)" in refused.reason
    assert LIMITS.decide(stranger(8), held, 0.0) == Admit(), "another network is served"
    assert LIMITS.decide(member(7, net), held, 0.0) == Admit(), "a member is outside it"
    # Members' sessions do not count towards their network's share either.
    mixed = [slot("m", member(5, net)), *held[:2]]
    assert LIMITS.decide(stranger(7, net), mixed, 0.0) == Admit()
    # The node itself has no network.
    assert LIMITS.decide(Holder(b"\x09" * 32, None, True), held, 0.0) == Admit()


def full_of_squatters(opened_at: float = 0.0) -> list[Slot]:
    """Four strangers from four networks, one unused session each."""
    return [slot(f"s{n}", stranger(n), opened_at) for n in range(4)]


def test_a_pending_session_keeps_its_slot_through_its_grace() -> None:
    refused = LIMITS.decide(stranger(9), full_of_squatters(), GRACE - 0.01)
    assert isinstance(refused, Refuse) and "session limit (4)" in refused.reason


def test_past_its_grace_a_pending_session_gives_way_oldest_first() -> None:
    held = full_of_squatters()
    held[2] = slot("s2", stranger(2), opened_at=-1.0)
    decision = LIMITS.decide(stranger(9), held, GRACE)
    assert decision == Admit(
        "s2",
        f"displaced: no forward within {GRACE:g} s of open while this hop was full",
        graced=False,
    ), "a session that displaced another gets no grace of its own"
    # ...so it gives way at once, to an asker that would even things out.
    fresh = full_of_squatters(opened_at=GRACE)
    fresh[2] = Slot("s2", stranger(9), GRACE, False, GRACE, graced=False)
    decision = LIMITS.decide(stranger(10), fresh, GRACE + 0.01)
    assert isinstance(decision, Admit) and decision.displace == "s2"


def test_a_started_session_never_gives_way_to_a_stranger() -> None:
    held = [slot(f"s{n}", stranger(n), started=True) for n in range(4)]
    assert isinstance(LIMITS.decide(stranger(9), held, 1000.0), Refuse)


def test_pending_sessions_give_way_only_to_an_asker_holding_fewer() -> None:
    """Equals never churn each other's slots: squatters holding one each
    cannot displace one another; a newcomer holding none can, and takes
    from the heaviest holder first."""
    five = SessionLimits(max_sessions=5)
    one_each = [slot(f"s{n}", stranger(n)) for n in range(5)]
    refused = five.decide(stranger(1), one_each, GRACE)
    assert isinstance(refused, Refuse), "holding one, it may not displace a holder of one"
    assert isinstance(five.decide(stranger(9), one_each, GRACE), Admit)
    a, b = stranger(1), stranger(2)
    heavy = [slot("a1", a, -1.0), slot("b1", b, -2.0), slot("b2", b, -0.5)]
    heavy += [slot("x", stranger(4), -3.0), slot("y", stranger(5), -3.0)]
    decision = five.decide(stranger(9), heavy, GRACE)
    assert isinstance(decision, Admit) and decision.displace == "b1"
    decision = five.decide(a, heavy, GRACE)
    assert isinstance(decision, Refuse), "one apart (a holds one, b two): no swap"
    heavy[0] = slot("b3", b, -1.0)
    decision = five.decide(stranger(4), heavy, GRACE)
    assert isinstance(decision, Admit) and decision.displace == "b1", "two apart: it evens out"


def test_a_member_with_standing_displaces_strangers_pending_first() -> None:
    held = [slot(f"s{n}", stranger(n), started=True) for n in range(3)]
    held.append(slot("fresh", stranger(3), opened_at=1.0))  # within its grace
    decision = LIMITS.decide(member(9), held, 1.0)
    assert isinstance(decision, Admit) and decision.displace == "fresh"
    assert "standing" in decision.why and decision.graced, "a member's session keeps its grace"
    # No stranger pending: the least recently used started one.
    held[3] = Slot("s3", stranger(3), 0.0, True, last_used=-5.0)
    decision = LIMITS.decide(member(9), held, 1.0)
    assert isinstance(decision, Admit) and decision.displace == "s3"


def test_members_keep_their_started_sessions_even_from_members() -> None:
    held = [slot(f"m{n}", member(n), started=True) for n in range(4)]
    assert isinstance(LIMITS.decide(member(9), held, 1000.0), Refuse)
    assert isinstance(LIMITS.decide(stranger(9), held, 1000.0), Refuse)
    # ...but a member's session that never forwarded gives way past its grace.
    held[0] = slot("m0", member(0))
    decision = LIMITS.decide(stranger(9), held, GRACE)
    assert isinstance(decision, Admit) and decision.displace == "m0"


def test_standing_is_earned_lost_and_bounded() -> None:
    standing = Standing(max_peers=2)
    standing.earn(b"a")
    standing.earn(b"b")
    assert b"a" in standing and len(standing) == 2
    standing.earn(b"a")  # served again: the most recent
    standing.earn(b"c")
    assert b"b" not in standing and {b"a", b"c"} == {p for p in (b"a", b"b", b"c") if p in standing}
    standing.lose(b"a")
    standing.lose(b"zz")  # losing what it never had is nothing
    assert b"a" not in standing and len(standing) == 1
