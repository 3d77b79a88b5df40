"""Two processes holding one node key: which one stops.

A copied state dir gives two processes one identity. Both learn of it (each
sees the other sign an incarnation it never signed; the membership driver
sets `twin_found`). `stop_if_identity_taken` decides by age: a process that
learns it within `TWIN_STARTUP_WINDOW_S` of being up is the newcomer and
stops with an error instead of fighting the running node for its id; one up
longer is the established node and stays, refuting as SWIM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol

import trio

from mesh.identity import node_id_text
from runtime.node.options import NodeStartupError

TWIN_STARTUP_WINDOW_S: Final = {"lan": 30.0, "wan": 120.0, "local": 10.0}
"""Both processes holding one key learn of each other (each sees the other
sign an incarnation it never signed). One that learns it this soon after
it was up (planes bound, API serving), by profile, is the newcomer: it
stops with an error instead of fighting the running node for its id. One
up longer is the established node: it keeps refuting, as SWIM does, and
stays. The window must cover a join and a refutation's round trip on the profile's network,
on a loaded machine too (`local` is for one machine, where a busy CPU is
what delays them); two copies started within one window of each other
both stop."""


def is_newcomer(profile: str, ready_mono: float | None, now: float) -> bool:
    """Whether a process up since `ready_mono` (None: still starting) is the
    newcomer of a twin pair at trio time `now`."""
    return ready_mono is None or now - ready_mono <= TWIN_STARTUP_WINDOW_S[profile]


class TwinWatch(Protocol):
    """What the decision reads of the membership driver (`MembershipDriver`)."""

    @property
    def node_id(self) -> bytes: ...
    @property
    def twin_found(self) -> trio.Event: ...
    @property
    def twin_addr(self) -> str | None: ...


async def stop_if_identity_taken(
    membership: TwinWatch, profile: str, ready_mono: Callable[[], float | None]
) -> None:
    """Wait for a twin; return if this process, up since `ready_mono()` on
    network `profile`, is the established one, else raise NodeStartupError. It raises past the
    leave on purpose: a leave is a self-signed death of *this id*, which
    would take the running node down too."""
    await membership.twin_found.wait()
    if not is_newcomer(profile, ready_mono(), trio.current_time()):
        return
    raise NodeStartupError(
        f"node {node_id_text(membership.node_id)} is already alive at "
        f"{membership.twin_addr}: this state dir's key is in use by another "
        f"process (a copied state dir?); stop that node, or give this one its own "
        f"--state-dir"
    )
