"""The record publisher: what this node's record says, and when it is republished."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import trio

from mesh import records
from runtime.node import record_publisher
from runtime.node.admission import Admission
from runtime.node.record_publisher import LOAD_PUBLISH_S, RTT_PUBLISH_S, RecordPublisher

ADDRESSES = {"control": "tcp://127.0.0.1:1", "data": "tcp://127.0.0.1:2", "api": "http://x:3"}
NOTICE = records.LedgerNotice(term=2, index=7, digest="ab" * 32)
SHARD = records.Assignment("m1", (0, 4), "fp32", "operator", False, 1)


@dataclass
class Slot:
    admission: Admission | None = None
    backend: records.BackendInfo | None = None


class Parts:
    """What the publisher reads, as plain values a test can move."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.sessions = 0
        self.notice: records.LedgerNotice | None = None
        self.reach: records.Reach = "unknown"
        self.rtts: dict[bytes, float] = {}
        self.slot = Slot()

    def publisher(self, *, spare: bool = True) -> RecordPublisher:
        return RecordPublisher(
            publish=self.sent.append,
            addresses=lambda: ADDRESSES,
            started_at=1234.5,
            slot=self.slot,
            models=lambda: ("m1", "m2"),
            spare=spare,
            sessions=lambda: self.sessions,
            notice=lambda: self.notice,
            reach=lambda: self.reach,
            rtts=lambda: self.rtts,
        )

    def last(self) -> records.NodeRecord:
        return records.decode_record_body(self.sent[-1])


def test_republish_signs_what_the_node_stands_on() -> None:
    parts = Parts()
    parts.sessions = 3
    publisher = parts.publisher(spare=False)
    publisher.republish()
    record = parts.last()
    assert record.addresses == records.Addresses(**ADDRESSES)
    assert record.started_at == 1234.5
    assert record.models == ("m1", "m2")
    assert record.spare is False
    assert record.sessions == 3
    assert record.assignment is None and record.capability is None and record.ledger is None
    assert publisher.published_sessions == 3


def test_changed_takes_in_a_new_notice_and_only_once() -> None:
    parts = Parts()
    publisher = parts.publisher()
    publisher.republish()
    assert not publisher.changed()
    parts.notice = NOTICE
    assert publisher.changed()
    assert publisher.notice == NOTICE
    assert not publisher.changed()  # taken in: not due again
    publisher.republish()
    assert parts.last().ledger == NOTICE
    parts.notice = None  # this node stopped leading: the notice comes out
    assert publisher.changed()
    publisher.republish()
    assert parts.last().ledger is None


def test_load_is_republished_at_most_every_load_publish_s() -> None:
    parts = Parts()
    publisher = parts.publisher()
    publisher.republish()
    parts.sessions = 5
    assert not publisher.changed(), "load moved, but the last publish is too recent"
    publisher.load_published_at = time.monotonic() - LOAD_PUBLISH_S  # as if published then
    assert publisher.changed()
    publisher.republish()
    assert parts.last().sessions == 5
    publisher.load_published_at = time.monotonic() - 2 * LOAD_PUBLISH_S
    assert not publisher.changed(), "due, but the load did not move"


def test_a_fresh_publisher_may_publish_load_at_once() -> None:
    parts = Parts()
    parts.sessions = 1
    assert parts.publisher().changed()


async def test_run_republishes_what_drifted(autojump_clock: object) -> None:
    parts = Parts()
    publisher = parts.publisher()
    publisher.republish()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(publisher.run)
        await trio.sleep(1.0)
        assert len(parts.sent) == 1, "nothing drifted: nothing sent"
        parts.notice = NOTICE
        await trio.sleep(record_publisher.NOTICE_INTERVAL_S + 0.01)
        assert parts.last().ledger == NOTICE
        nursery.cancel_scope.cancel()


class Admitted:
    """An admission that holds `SHARD` with a valid capability report."""

    def __init__(self) -> None:
        now = time.time()
        self.capability = records.CapabilityReport(
            result="admitted",
            model="m1",
            manifest_digest="ab" * 32,
            layers=(0, 4),
            recipe="fp32",
            backend="torch",
            prefill_tokens_per_s=100.0,
            decode_tokens_per_s=10.0,
            validated_at=now - 1.0,
            expires_at=now + 600.0,
            failure=None,
        )

    def assignment(self) -> records.Assignment:
        return SHARD


def test_withdraw_takes_the_capability_out_and_keeps_the_assignment() -> None:
    parts = Parts()
    parts.slot.admission = cast(Any, Admitted())
    publisher = parts.publisher()
    publisher.republish()
    assert parts.last().capability is not None
    assert parts.last().assignment == SHARD
    publisher.withdraw()
    assert publisher.draining
    assert len(parts.sent) == 2
    assert parts.last().capability is None
    assert parts.last().assignment == SHARD


def test_the_record_says_how_peers_reach_the_node() -> None:
    parts = Parts()
    publisher = parts.publisher()
    publisher.republish()
    assert parts.last().reach == "unknown"
    parts.reach = "direct"  # the reachability driver's verdict, then its republish
    publisher.republish()
    assert parts.last().reach == "direct"


def test_round_trips_are_published_nearest_first_and_again_only_when_they_move() -> None:
    parts = Parts()
    parts.rtts = {bytes([i]) * 32: 0.001 * (i + 1) for i in range(records.MAX_RTT_PEERS + 4)}
    publisher = parts.publisher()
    publisher.republish()
    published = parts.last().rtt_us
    assert len(published) == records.MAX_RTT_PEERS
    assert published["00" * 32] == 1_000 and "ff" * 32 not in published
    parts.rtts[b"\x00" * 32] = 0.0025  # +1.5 ms: under RTT_MOVED_MIN_US
    publisher.rtts_published_at = time.monotonic() - RTT_PUBLISH_S
    assert not publisher.changed(), "due, but nothing moved enough"
    parts.rtts[b"\x00" * 32] = 0.010
    publisher.rtts_published_at = time.monotonic()
    assert not publisher.changed(), "moved, but the last publish is too recent"
    publisher.rtts_published_at = time.monotonic() - RTT_PUBLISH_S
    assert publisher.changed()
    publisher.republish()
    assert parts.last().rtt_us["00" * 32] == 10_000
