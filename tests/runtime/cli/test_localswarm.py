"""`LocalSwarm.stop` always ends a node, as `make demo`'s stop step needs:
a node slow to drain is told again, then killed, and never turns the stop
into a timeout and a traceback (the issue's "node0 did not exit within
10.0s"). Real subprocesses that treat SIGTERM as a node would, or worse."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from runtime.cli import localswarm
from runtime.cli.localswarm import LocalNode, LocalSwarm

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
