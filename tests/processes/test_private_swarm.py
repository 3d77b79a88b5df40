"""A private swarm, scripted with real node processes on loopback.

The founder starts with `--swarm private`. A stranger that only knows its
address and id is refused at the handshake (the founder counts it; the
stranger never becomes a member); a node invited with `shardmesh invite`
joins; an expired invitation and a forged one are refused, with one clear
line, before the node joins anything.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views, all_see
from tests.swarm_helpers import CONVERGE_TIMEOUT_S, START_TIMEOUT_S, wait_for

EXIT_TIMEOUT_S = 30.0
INVITE = (sys.executable, "-m", "runtime.cli", "invite")


def _founded_private(node: LocalNode):  # type: ignore[no-untyped-def]
    def check(views: Views) -> bool:
        swarm = (views.get(node.name) or {}).get("swarm")
        return swarm is not None and swarm["mode"] == "private"

    return check


def _invite(node: LocalNode, *extra: str) -> str:
    """`shardmesh invite` against `node`, with its operator token."""
    result = subprocess.run(
        [*INVITE, "--api", node.api, "--state-dir", str(node.state_dir), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


async def _exits_refused(swarm: LocalSwarm, node: LocalNode, token: str) -> str:
    """Start `node` with `--invite token`; it must fail to start (exit 1)
    before joining.
    Its log's last lines."""
    node.args = ["--invite", token]
    await swarm.start(node)
    assert node.process is not None
    with trio.fail_after(EXIT_TIMEOUT_S):
        code = await node.process.wait()
    assert code == 1, node.log_tail()
    return node.log_tail(5)


@pytest.mark.slow
async def test_a_private_swarm_admits_only_invited_nodes(swarm: LocalSwarm) -> None:
    founder = swarm.new_node("founder", args=["--swarm", "private"])
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], _founded_private(founder), CONVERGE_TIMEOUT_S, "founded")

    # A stranger knows where the founder is and who it is, but holds no
    # invitation: every handshake is refused, so it never gets a word in.
    stranger = swarm.new_node("stranger")
    await swarm.start_ready(stranger, [founder.seed], timeout=START_TIMEOUT_S)

    def refused(views: Views) -> bool:
        drops = (views.get(founder.name) or {}).get("drops", {})
        return drops.get("control.handshake_refused", 0) >= 2

    await wait_for(swarm, [founder], refused, CONVERGE_TIMEOUT_S, "the stranger refused")
    views = await swarm.views([founder, stranger])
    founder_view, stranger_view = views[founder.name], views[stranger.name]
    assert founder_view is not None and stranger_view is not None
    assert {m["node_id"] for m in founder_view["members"]} == {founder.node_id}
    assert founder.node_id not in {
        m["node_id"] for m in stranger_view["members"] if m["state"] == "alive"
    }

    # An invited node joins: redeemed, admitted by the leader, then let in.
    guest = swarm.new_node("guest", args=["--invite", _invite(founder)])
    await swarm.start_ready(guest, timeout=START_TIMEOUT_S)
    pair = [founder, guest]
    await wait_for(swarm, pair, all_see(pair, pair, "alive"), CONVERGE_TIMEOUT_S, "guest in")
    swarm_view = (await swarm.views([founder]))[founder.name]
    assert swarm_view is not None
    admitted = [m["node_id"] for m in swarm_view["swarm"]["admitted"]]
    assert admitted == [guest.node_id]
    assert stranger.node_id not in {m["node_id"] for m in swarm_view["members"]}

    # An invitation that expired, and one whose signature was tampered
    # with, are refused before the node joins anything.
    expired = _invite(founder, "--expires", "1s")
    await trio.sleep(1.5)
    late = swarm.new_node("late")
    assert "expired" in await _exits_refused(swarm, late, expired)
    genuine = _invite(founder, "--voter")
    forged = genuine[:-6] + ("AAAAAA" if not genuine.endswith("AAAAAA") else "BBBBBB")
    forger = swarm.new_node("forger")
    assert "refused the invitation" in await _exits_refused(swarm, forger, forged)
    final = (await swarm.views([founder]))[founder.name]
    assert final is not None
    assert [m["node_id"] for m in final["swarm"]["admitted"]] == [guest.node_id]
