"""The held-bytes ledger: which connections make libzmq hold what the plane
never took, and which of them to cut (`mesh.held_bytes`)."""

from __future__ import annotations

import pytest

from mesh.held_bytes import COMMAND_BYTES_PER_S, FRAME_WIRE_BYTES, HeldBytes

MIB = 1024 * 1024
LIMIT = 6 * MIB
TOTAL = 16 * MIB


def ledger(*connections: int) -> HeldBytes:
    held = HeldBytes(LIMIT, TOTAL)
    for connection in connections:
        held.opened(connection, 0)
    return held


def test_what_is_read_and_not_taken_is_held() -> None:
    held = ledger(7)
    held.read(7, 0, now=0.0)
    held.took(7, 3 * MIB, frames=3)
    held.read(7, 5 * MIB, now=0.01)  # three taken, two still inside libzmq
    assert 2 * MIB - 3 * FRAME_WIRE_BYTES - 100 < held.held(7) <= 2 * MIB
    assert held.to_cut() == []


def test_bytes_read_before_the_ledger_heard_of_a_connection_are_not_counted() -> None:
    held = HeldBytes(LIMIT, TOTAL)
    held.opened(7, 50 * MIB)  # the plane took those before the monitor's event came
    held.read(7, 50 * MIB + 1000, now=0.0)
    assert held.held(7) == 1000


def test_a_message_that_never_ends_is_cut_past_the_limit_and_leaves_the_ledger() -> None:
    held = ledger(7, 8)
    for step in range(1, 8):
        held.read(7, step * MIB, now=step * 0.005)
        held.read(8, step * 1000, now=step * 0.005)
        held.took(8, 1000, frames=1)
        if step * MIB <= LIMIT:
            assert held.to_cut() == []
    assert held.to_cut() == [7]
    assert held.cuts == 1 and len(held) == 1 and held.held(7) == 0


def test_stalled_connections_over_the_total_lose_their_largest_until_within() -> None:
    held = ledger(1, 2, 3, 4, 5)
    for connection in (1, 2, 3, 4, 5):
        held.read(connection, 0, now=0.0)
    for connection in (1, 2, 3):
        held.read(connection, 5 * MIB, now=0.01)
    held.took(4, 5 * MIB, frames=5)  # the plane took from 4: not stalled,
    held.read(4, 10 * MIB, now=0.01)  # though it holds 5 MiB more
    assert held.to_cut() == []  # stalled: 15 MiB, within 16
    for connection, size in ((1, 5.7), (2, 5.9), (3, 5.8), (5, 5.6)):
        held.read(connection, int(size * MIB), now=0.02)
    # Stalled: 23 MiB. The largest go until the rest are within 16 MiB.
    assert held.to_cut() == [2, 3]
    assert held.held(4) > 4 * MIB  # a busy plane's queue is never cut for the total


def test_a_quiet_connections_commands_never_add_up() -> None:
    held = ledger(7)
    heartbeats = 0
    for second in range(86_400 * 7):  # a week of PING and PONG, read every 10 minutes
        if second % 600 == 0:
            held.read(7, heartbeats, now=float(second))
        heartbeats += COMMAND_BYTES_PER_S // 2
    assert held.held(7) == 0
    assert held.to_cut() == []


def test_a_lower_count_is_a_new_connection_under_a_reused_number() -> None:
    held = ledger(7)
    held.read(7, 0, now=0.0)
    held.read(7, 5 * MIB, now=0.01)
    held.read(7, 1000, now=0.02)  # closed and reopened before the event came
    assert held.held(7) == 0
    held.read(7, 2000, now=0.02)
    assert held.held(7) == 1000


def test_a_connection_closed_or_unknown_is_nobodys() -> None:
    held = ledger(7)
    held.closed(7)
    held.took(7, MIB, frames=1)
    assert held.held(7) == 0 and len(held) == 0


def test_limits_must_be_positive_and_ordered() -> None:
    with pytest.raises(ValueError):
        HeldBytes(0, 1)
    with pytest.raises(ValueError):
        HeldBytes(2, 1)
