"""This node's signed record (`mesh.records.NodeRecord`), kept true.

`RecordPublisher.republish` re-signs and gossips the record: where to
reach the node and, once its doctor has run, its backend, assignment and
capability. `RecordPublisher.run` republishes when what the record says
drifts from the node (the leader's ledger notice, the open-session count,
the round trips membership measured to its nearest members), each at a
bounded rate so record traffic does not grow with the chat rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol

import trio

from mesh import records
from mesh.identity import node_id_text
from runtime.node.admission import Admission

NOTICE_INTERVAL_S: Final = 0.5
"""The leader republishes its ledger notice at most this often: a commit
reaches members within a gossip spread plus this, and a burst of commits
is one record."""
LOAD_PUBLISH_S: Final = 5.0
"""A node republishes its open-session count (its load, on every member's
swarm page) at most this often when it changed: each republish is gossiped
to every member, and load changes with every request, so publishing each
change would make record traffic grow with the chat rate. Five seconds
keeps a busy node to one record per gossip spread or so, and a page that
refreshes every few seconds no more than one publish behind."""


RTT_PUBLISH_S: Final = 10.0
"""A node republishes its measured round trips (`NodeRecord.rtt_us`) at most
this often, and only when they moved (`rtts_moved`): routes need them to
the millisecond, not to the second, and a path changes rarely."""
RTT_MOVED_FRACTION: Final = 0.25
"""A round trip has moved when it changed by more than this fraction (and by
more than `RTT_MOVED_MIN_US`): probe-to-probe noise stays below it."""
RTT_MOVED_MIN_US: Final = 2_000
"""...and by more than 2 ms: on a LAN the fraction alone is noise."""


def published_rtts(rtts: Mapping[bytes, float]) -> dict[str, int]:
    """What a record says of `rtts` (member -> seconds): the nearest
    `records.MAX_RTT_PEERS`, by hex id, in whole microseconds."""
    nearest = sorted(rtts.items(), key=lambda item: (item[1], item[0]))[: records.MAX_RTT_PEERS]
    return {node_id_text(node): min(round(rtt * 1e6), records.MAX_RTT_US) for node, rtt in nearest}


def rtts_moved(published: Mapping[str, int], now: Mapping[str, int]) -> bool:
    """Whether `now` says something `published` does not: another set of
    members, or a round trip that moved (`RTT_MOVED_FRACTION`, `RTT_MOVED_MIN_US`)."""
    if published.keys() != now.keys():
        return True
    for node, rtt in now.items():
        change = abs(rtt - published[node])
        if change > RTT_MOVED_MIN_US and change > RTT_MOVED_FRACTION * published[node]:
            return True
    return False


class ServedShard(Protocol):
    """What the record says about the shard served (`ShardSlot` is the real one)."""

    @property
    def admission(self) -> Admission | None: ...

    @property
    def backend(self) -> records.BackendInfo | None: ...


class RecordPublisher:
    """Builds, signs (through `publish`) and refreshes this node's record."""

    def __init__(
        self,
        *,
        publish: Callable[[bytes], None],
        addresses: Callable[[], dict[str, str]],
        started_at: float,
        slot: ServedShard,
        models: Callable[[], tuple[str, ...]],
        spare: bool,
        sessions: Callable[[], int],
        notice: Callable[[], records.LedgerNotice | None],
        reach: Callable[[], records.Reach] = lambda: "unknown",
        rtts: Callable[[], Mapping[bytes, float]] = dict,
        relayed: Callable[[], tuple[records.RelayedAt, ...]] = tuple,
    ) -> None:
        """`publish` gossips an encoded record body (the membership driver
        signs it); `spare` is whether placement may give this node a shard
        (one assignment per node until multi-shard slots exist, ADR-0026: a
        node pinned by its operator has no spare slot); `notice` is the Raft
        driver's ledger notice (None unless this node leads); `reach` how
        peers reach this node (`runtime.node.reachability_driver`); `rtts`
        the round trips membership measured (`Membership.rtts`); `relayed`
        the relays this node is reached through (`runtime.node.relays`)."""
        self._publish = publish
        self._addresses = addresses
        self._started_at = started_at
        self._slot = slot
        self._models = models
        self._spare = spare
        self._sessions = sessions
        self._notice_of = notice
        self._reach = reach
        self._rtts = rtts
        self._relayed = relayed
        self.published_rtts: dict[str, int] = {}
        self.rtts_published_at = -RTT_PUBLISH_S  # time.monotonic() of the last publish
        self.draining = False
        """Set by `withdraw`: the record stops carrying the capability."""
        self.notice: records.LedgerNotice | None = None  # in our record: we lead
        self.published_sessions = 0
        self.load_published_at = -LOAD_PUBLISH_S  # time.monotonic() of the last publish

    def record(self) -> records.NodeRecord:
        """The record as the node stands now."""
        admission = self._slot.admission
        return records.NodeRecord(
            addresses=records.Addresses(**self._addresses(), relayed=self._relayed()),
            started_at=self._started_at,
            backend=self._slot.backend,
            assignment=admission.assignment() if admission else None,
            capability=admission.capability if admission and not self.draining else None,
            models=self._models(),
            spare=self._spare,
            ledger=self.notice,
            sessions=self._sessions(),
            reach=self._reach(),
            rtt_us=published_rtts(self._rtts()),
        )

    def republish(self) -> None:
        """Re-sign and gossip the record."""
        record = self.record()
        self.published_sessions = record.sessions
        self.published_rtts = dict(record.rtt_us)
        self.load_published_at = self.rtts_published_at = time.monotonic()
        self._publish(records.encode_record_body(record))

    def withdraw(self) -> None:
        """Take this node's capability out of its record: routes stop
        naming it (a drain's first step, `runtime.node.drain`)."""
        self.draining = True
        self.republish()

    def changed(self) -> bool:
        """Whether the record is due: the leader's ledger notice changed
        (taken out when this node stops leading), or the open-session
        count moved and `LOAD_PUBLISH_S` has passed since the last publish,
        or the round trips moved and `RTT_PUBLISH_S` has. A changed notice
        is taken in."""
        notice = self._notice_of()
        now = time.monotonic()
        load_due = now - self.load_published_at >= LOAD_PUBLISH_S
        load_moved = self._sessions() != self.published_sessions
        rtts_due = now - self.rtts_published_at >= RTT_PUBLISH_S
        rtts_due = rtts_due and rtts_moved(self.published_rtts, published_rtts(self._rtts()))
        if notice != self.notice or (load_due and load_moved) or rtts_due:
            self.notice = notice
            return True
        return False

    async def run(self) -> None:
        """Republish what drifted, checked every `NOTICE_INTERVAL_S`: members
        outside Raft follow the ledger by the leader's notice."""
        while True:
            await trio.sleep(NOTICE_INTERVAL_S)
            if self.changed():
                self.republish()
