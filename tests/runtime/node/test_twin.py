"""Two processes with one key: the newcomer stops, the established node stays."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio

from runtime.node.options import NodeStartupError
from runtime.node.twin import TWIN_STARTUP_WINDOW_S, is_newcomer, stop_if_identity_taken

NODE = bytes(range(32))


def test_newcomer_by_age_on_the_profile_window() -> None:
    window = TWIN_STARTUP_WINDOW_S["lan"]
    assert is_newcomer("lan", None, 1000.0), "still starting: the newcomer"
    assert is_newcomer("lan", 1000.0, 1000.0 + window)
    assert not is_newcomer("lan", 1000.0, 1000.0 + window + 0.1)
    assert is_newcomer("wan", 1000.0, 1000.0 + window + 0.1), "wan's window is longer"
    assert TWIN_STARTUP_WINDOW_S["local"] < window < TWIN_STARTUP_WINDOW_S["wan"]


@dataclass
class Membership:
    node_id: bytes = NODE
    twin_found: trio.Event = field(default_factory=trio.Event)
    twin_addr: str | None = "tcp://10.0.0.9:7000"


async def test_a_newcomer_stops_with_a_clear_error(autojump_clock: object) -> None:
    membership = Membership()
    up = trio.current_time()
    await trio.sleep(1.0)
    membership.twin_found.set()
    with pytest.raises(
        NodeStartupError, match=r"already alive at tcp://10\.0\.0\.9:7000"
    ) as caught:
        await stop_if_identity_taken(membership, "local", lambda: up)
    assert NODE.hex() in str(caught.value)
    assert "--state-dir" in str(caught.value)


async def test_the_established_node_stays(autojump_clock: object) -> None:
    membership = Membership()
    up = trio.current_time()
    await trio.sleep(TWIN_STARTUP_WINDOW_S["local"] + 1.0)
    membership.twin_found.set()
    await stop_if_identity_taken(membership, "local", lambda: up)  # returns: no error
