"""A stop that drains: what a node does between SIGTERM and leaving the swarm.

A node asked to stop refuses new sessions and withdraws its capability from
its record; if the swarm can serve its span without it (`others_hold`) it
hands its open sessions over (each entry fails over at once), else it keeps
serving them until they end, for at most `DRAIN_GRACE_S`. Then it leaves the
swarm (`stop_on_signal`); a second signal cuts the drain short
(`stop_at_once_on`).

Why, step by step: docs/design/node.md#the-drain-stopping-without-breaking-streams.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

import trio

from mesh.coverage import CoverageMap
from mesh.member_table import LIVE_STATES
from runtime.inference.hop_server import HopServer
from runtime.node.admission import Admission

log = logging.getLogger("shardmesh.node")

DRAIN_GRACE_S: Final = 300.0
"""Longest a node that is the only holder of its span keeps serving open
sessions after SIGTERM: a long answer (a few thousand tokens on a slow
chain) finishes; a stuck one does not hold the stop forever. Supervisors'
stop timeouts must exceed it (systemd's TimeoutStopSec, launchd's
ExitTimeOut) or they kill the node mid-answer."""
HAND_OVER_WAIT_S: Final = 5.0
"""After handing sessions over, how long to wait for their entries' closes
(an entry closes a failed chain at once; this only bounds a lost close)."""
POLL_S: Final = 0.1


def others_hold(coverage: CoverageMap, me: bytes, model: str, layers: tuple[int, int]) -> bool:
    """Whether every layer of `layers` of `model` is held by some live node
    other than `me` in the variant `me` serves (so entries can re-route)."""
    for entry in coverage.for_model(model):
        if not any(node.node_id == me for node in entry.nodes):
            continue
        others = [n for n in entry.nodes if n.node_id != me and n.state in LIVE_STATES]
        return all(
            any(a <= layer < b for a, b in (n.layers for n in others)) for layer in range(*layers)
        )
    return False


def span_replaceable(
    admission: Admission | None, coverage: Callable[[], CoverageMap], me: bytes
) -> bool:
    """Whether the swarm can serve the span `admission` serves on node `me`
    without it (False when it serves none)."""
    assignment = admission.assignment() if admission else None
    if assignment is None:
        return False
    return others_hold(coverage(), me, assignment.model, assignment.layers)


async def drain(
    hop: HopServer | None,
    *,
    withdraw: Callable[[], None],
    replaceable: Callable[[], bool],
    grace_s: float = DRAIN_GRACE_S,
) -> None:
    """Drain `hop` (None: no shard, nothing to drain). `withdraw` takes the
    node's capability out of its record; `replaceable` says whether the
    swarm can serve the span without this node (`others_hold`)."""
    if hop is None:
        return
    # Asked before withdrawing: this node's own view of the coverage stops
    # listing it once its record no longer carries its capability.
    can_hand_over = replaceable()
    hop.leaving = True
    withdraw()
    if not hop.sessions:
        return
    if can_hand_over:
        handed = hop.hand_over()
        log.info("handed %d open session(s) over to other holders of this span", handed)
        limit = HAND_OVER_WAIT_S
    else:
        log.info(
            "the only holder of this span: serving %d open session(s) to their end "
            "(at most %.0f s; signal again to stop now)",
            hop.sessions,
            grace_s,
        )
        limit = grace_s
    with trio.move_on_after(limit):
        while hop.sessions:
            await trio.sleep(POLL_S)
    if hop.sessions:
        log.warning("stopping with %d session(s) still open", hop.sessions)


async def stop_on_signal(
    signals: AsyncIterator[int],
    nursery: trio.Nursery,
    hop: Callable[[], HopServer | None],
    *,
    withdraw: Callable[[], None],
    replaceable: Callable[[], bool],
    leave: Callable[[], Awaitable[None]],
) -> None:
    """On the first signal: `drain` (a second signal cuts it short), then
    `leave` the swarm (membership announces the leave and keeps gossiping
    for a short bounded grace); the caller then cancels the rest. `nursery` runs the
    watcher for the second signal."""
    async for signum in signals:
        log.info("%s: stopping (signal again to stop at once)", signal.Signals(signum).name)
        break
    with trio.CancelScope() as draining:
        nursery.start_soon(stop_at_once_on, signals, draining)
        await drain(hop(), withdraw=withdraw, replaceable=replaceable)
    log.info("leaving the swarm")
    await leave()


async def stop_at_once_on(signals: AsyncIterator[int], draining: trio.CancelScope) -> None:
    """A second SIGTERM or Ctrl-C during the drain: stop draining now."""
    async for signum in signals:
        log.info("%s again: stopping now", signal.Signals(signum).name)
        draining.cancel()
        return
