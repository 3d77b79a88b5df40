"""Sybil bounds (`mesh.newcomers`): which neighbourhood an address is in,
and how many new identities each address and prefix may bring in. The
membership core's use of them is in test_membership_trust.py, the
handshake gate's in test_zap.py."""

from __future__ import annotations

import pytest

from mesh.newcomers import (
    R_ADDRESS,
    R_INTRODUCER,
    R_INTRODUCTIONS,
    R_PREFIX,
    IntroductionLimit,
    NewcomerLimit,
    neighbourhood,
)


def test_neighbourhoods_are_an_address_and_its_24_or_48() -> None:
    assert neighbourhood("tcp://10.1.2.3:7000") == ("10.1.2.3", "10.1.2.0/24")
    assert neighbourhood("10.1.2.3") == ("10.1.2.3", "10.1.2.0/24")  # as ZAP reports it
    assert neighbourhood("tcp://[2001:db8:1:2::5]:7000") == ("2001:db8:1:2::5", "2001:db8:1::/48")
    assert neighbourhood("2001:db8:1:2::5") == ("2001:db8:1:2::5", "2001:db8:1::/48")
    assert neighbourhood("::ffff:10.1.2.3") == ("10.1.2.3", "10.1.2.0/24")
    assert neighbourhood("tcp://node7.lab:7000") == ("node7.lab", "node7.lab")
    assert neighbourhood("sim://12") == ("12", "12")


def test_a_limit_admits_a_burst_then_a_steady_rate() -> None:
    limit = NewcomerLimit(2, 3)
    assert [limit.admit("10.0.0.1", 0.0) for _ in range(3)] == [None, None, R_ADDRESS]
    assert limit.admit("10.0.0.2", 0.0) is None
    assert limit.admit("10.0.0.3", 0.0) == R_PREFIX
    assert limit.admit("10.0.1.1", 0.0) is None  # another /24
    assert limit.admit("10.0.0.3", 20.0) is None  # a third of a minute: one token back
    assert limit.admit("10.0.0.4", 20.0) == R_PREFIX
    assert limit.admit("10.0.0.1", 60.0) is None
    with pytest.raises(ValueError):
        NewcomerLimit(0, 1)


def test_a_refusal_takes_nothing_and_refusal_answers_without_taking() -> None:
    limit = NewcomerLimit(1, 5)
    assert limit.refusal("10.0.0.1", 0.0) is None
    assert limit.refusal("10.0.0.1", 0.0) is None  # asking twice takes nothing
    assert limit.admit("10.0.0.1", 0.0) is None
    assert limit.refusal("10.0.0.1", 0.0) == R_ADDRESS
    for _ in range(10):  # refused over and over: the prefix is not charged
        assert limit.admit("10.0.0.1", 0.0) == R_ADDRESS
    assert [limit.admit(f"10.0.0.{i}", 0.0) for i in range(2, 7)] == [None] * 4 + [R_PREFIX]


def test_a_bucket_refills_to_its_capacity_and_no_further() -> None:
    limit = NewcomerLimit(2, 100, window=10.0)
    assert limit.admit("10.0.0.1", 0.0) is None
    assert limit.admit("10.0.0.1", 0.0) is None
    assert limit.admit("10.0.0.1", 4.9) == R_ADDRESS  # a token takes 5 s
    assert limit.admit("10.0.0.1", 5.0) is None
    # Idle for an hour: full again, but only to the burst of 2.
    assert [limit.admit("10.0.0.1", 3600.0) for _ in range(3)] == [None, None, R_ADDRESS]


def test_only_the_most_recent_buckets_are_kept() -> None:
    """A forgotten bucket is a full one: with room for two neighbourhoods,
    a third pushes out the least recently used."""
    limit = NewcomerLimit(1, 1, max_tracked=2)
    assert limit.admit("10.0.1.1", 0.0) is None
    assert limit.admit("10.0.2.1", 0.0) is None
    assert limit.admit("10.0.1.1", 0.0) == R_ADDRESS
    assert limit.admit("10.0.3.1", 0.0) is None  # 10.0.1.x is forgotten
    assert limit.admit("10.0.1.1", 0.0) is None
    assert limit.admit("10.0.3.1", 0.0) == R_ADDRESS


def test_port_and_interface_do_not_make_another_address() -> None:
    limit = NewcomerLimit(1, 10)
    assert limit.admit("tcp://10.0.0.1:7000", 0.0) is None
    assert limit.admit("tcp://10.0.0.1:7001", 0.0) == R_ADDRESS
    assert limit.admit("10.0.0.1", 0.0) == R_ADDRESS
    assert neighbourhood("fe80::1%eth0") == ("fe80::1", "fe80::/48")


@pytest.mark.parametrize(
    ("per_address", "per_prefix", "window"), [(0, 1, 60.0), (1, 0, 60.0), (1, 1, 0.0)]
)
def test_limits_must_admit_someone_per_positive_window(
    per_address: int, per_prefix: int, window: float
) -> None:
    with pytest.raises(ValueError, match="at least 1 per positive window"):
        NewcomerLimit(per_address, per_prefix, window=window)


# --- introductions ---------------------------------------------------------------


def test_an_introducer_gets_exactly_its_bound_in_any_window_not_twice_it() -> None:
    limit = IntroductionLimit(3, 100, window=60.0)
    assert [limit.admit(b"m", t) for t in (0.0, 10.0, 20.0, 30.0)] == [None] * 3 + [R_INTRODUCER]
    assert limit.refusal(b"m", 59.9) == R_INTRODUCER  # the first is still in the window
    assert limit.admit(b"m", 60.0) is None  # ...and now it is out: one more
    assert limit.admit(b"m", 60.0) == R_INTRODUCER
    assert limit.admit(b"other", 60.0) is None  # another introducer, its own window


def test_all_introducers_together_share_the_total_and_a_refusal_takes_nothing() -> None:
    limit = IntroductionLimit(2, 3, window=60.0)
    assert [limit.admit(b"a", 0.0) for _ in range(3)] == [None, None, R_INTRODUCER]
    assert [limit.admit(b"b", 0.0) for _ in range(2)] == [None, R_INTRODUCTIONS]
    assert limit.refusal(b"c", 0.0) == R_INTRODUCTIONS
    # Refusals charged nothing: a minute on, everyone starts afresh.
    assert [limit.admit(who, 60.0) for who in (b"c", b"c", b"b")] == [None, None, None]
    assert limit.admit(b"a", 60.0) == R_INTRODUCTIONS


def test_only_the_most_recent_introducers_are_kept() -> None:
    limit = IntroductionLimit(1, 100, max_tracked=2)
    assert limit.admit(b"a", 0.0) is None
    assert limit.admit(b"b", 0.0) is None
    assert limit.admit(b"c", 0.0) is None  # a is forgotten: a fresh window
    assert limit.admit(b"a", 0.0) is None
    assert limit.admit(b"c", 0.0) == R_INTRODUCER


@pytest.mark.parametrize(
    ("per_member", "total", "window"), [(0, 1, 60.0), (1, 0, 60.0), (1, 1, 0.0)]
)
def test_introduction_limits_must_admit_someone_per_positive_window(
    per_member: int, total: int, window: float
) -> None:
    with pytest.raises(ValueError, match="at least 1 per positive window"):
        IntroductionLimit(per_member, total, window=window)
