"""`LocalSwarm.stop` always ends a node, as `make demo`'s stop step needs:
a node slow to drain is told again, then killed, and never turns the stop
into a timeout and a traceback (the issue's "node0 did not exit within
10.0s"). Real subprocesses that treat SIGTERM as a node would, or worse."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from runtime.cli import localswarm
from runtime.cli.localswarm import LocalNode, LocalSwarm
from tests.runtime.lab.fixtures import MakeLab, make_lab  # noqa: F401 - the fixture

SLOW_DRAIN = """
import signal, sys, time
told = []
def on_term(*_):
    told.append(1)
    if len(told) == 2:  # the second SIGTERM: stop at once
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
"""
"""Drains for longer than anyone waits (a minute), exits 0 when told twice."""

DEAF = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""
"""Ignores every SIGTERM: only SIGKILL ends it."""


async def started(tmp_path: Path, script: str) -> LocalNode:
    node = LocalNode("node0", tmp_path / "state", tmp_path / "node0.log")
    node.process = await trio.lowlevel.open_process(
        [sys.executable, "-c", script], stdout=subprocess.PIPE
    )
    assert node.process.stdout is not None
    line = await node.process.stdout.receive_some(16)
    assert line.startswith(b"ready")  # its handler is installed
    return node


async def test_a_node_slow_to_drain_gets_the_second_sigterm_and_exits_0(tmp_path: Path) -> None:
    node = await started(tmp_path, SLOW_DRAIN)
    with trio.fail_after(10):
        code = await LocalSwarm(tmp_path).stop(node, timeout=0.5)
    assert code == 0
    assert node.escalated == "SIGTERM"


async def test_a_node_deaf_to_sigterm_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localswarm, "STOP_AT_ONCE_S", 0.5)
    node = await started(tmp_path, DEAF)
    with trio.fail_after(10):
        code = await LocalSwarm(tmp_path).stop(node, timeout=0.5)
    assert code == -signal.SIGKILL
    assert node.escalated == "SIGKILL"


HTTP_ONCE = """
import socket, sys
listener = socket.create_server((sys.argv[1], 8123))
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    asked = conn.recv(1000).split(b"\\r\\n")[0]
    conn.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n%s" % (len(asked), asked))
    conn.close()
"""
"""Answers every HTTP request with its own request line."""


async def test_a_site_node_runs_in_its_namespace_on_its_address(
    make_lab: MakeLab,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    lab = make_lab({"sites": [{"name": "a"}, {"name": "b"}]})
    async with LocalSwarm(tmp_path, profile="wan", lab=lab) as swarm:
        node = swarm.new_node("n", site="b", forked=True)
        argv = swarm.command(node, ["ID@10.77.1.2:7000"])
        assert argv[1:4] == ["netns", "exec", lab.namespace("b")]
        assert argv[4:7] == [sys.executable, "-m", "runtime.cli"]
        assert argv[argv.index("--listen") + 1] == "10.77.2.2:0"
        assert argv[argv.index("--api") + 1] == "10.77.2.2:0"
        assert not node.forked  # a fork cannot leave the host's namespace


async def test_a_site_node_needs_a_lab(tmp_path: Path) -> None:
    async with LocalSwarm(tmp_path) as swarm:
        with pytest.raises(localswarm.SwarmError, match="given no lab"):
            swarm.new_node("n", site="a")


def test_the_bridge_reaches_a_listener_in_a_site_from_here(make_lab: MakeLab) -> None:  # noqa: F811
    lab = make_lab({"sites": [{"name": "a"}]})
    address = lab.address("a")
    server = lab.spawn("a", [sys.executable, "-c", HTTP_ONCE, address], stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdout.readline() == b"ready\n"
    bridge = localswarm.NamespaceBridge(lab.namespace("a"), lambda: f"http://{address}:8123")
    try:
        for path in ("/one", "/two"):  # a connection each, each in a thread of its own
            response = httpx.get(bridge.url + path, timeout=5)
            assert response.text == f"GET {path} HTTP/1.1"
        # No route from here reaches the site (whatever else may answer).
        try:
            direct: str | None = httpx.get(f"http://{address}:8123/one", timeout=1).text
        except httpx.HTTPError:
            direct = None
        assert direct != "GET /one HTTP/1.1"
    finally:
        bridge.close()
