"""`runtime.lab.probe`: the lab's instruments, run as processes on loopback
(the lab runs the same programs inside its namespaces)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

PROBE = [sys.executable, "-m", "runtime.lab.probe"]
TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [*PROBE, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def started(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*PROBE, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["ready"] is True
    return proc


@pytest.fixture
def echo_port() -> Iterator[int]:
    port = free_port()
    proc = started("echo", "--port", str(port), "--lifetime", "20")
    yield port
    proc.kill()
    proc.wait()


def test_ping_measures_round_trips_and_learns_how_it_was_seen(echo_port: int) -> None:
    local = free_port()
    result = run("ping", "--to", f"127.0.0.1:{echo_port}", "--count", "5", "--port", str(local))
    target = result["targets"][f"127.0.0.1:{echo_port}"]
    assert target["sent"] == 5 and len(target["rtt_ms"]) == 5
    assert all(0 < rtt < 1000 for rtt in target["rtt_ms"])
    assert target["seen_as"] == f"127.0.0.1:{local}" and result["local_port"] == local


def test_an_unanswered_ping_ends_after_its_wait() -> None:
    silent = free_port()
    start = time.monotonic()
    result = run("ping", "--to", f"127.0.0.1:{silent}", "--count", "3", "--wait", "0.3")
    assert result["targets"][f"127.0.0.1:{silent}"] == {"sent": 3, "rtt_ms": [], "seen_as": None}
    assert time.monotonic() - start < 5


def test_a_punching_echo_sends_first(echo_port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(10)
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        proc = started("echo", "--port", str(free_port()), "--punch", target, "--lifetime", "5")
        try:
            assert listener.recv(100) == b"punch"
        finally:
            proc.kill()
            proc.wait()


def test_an_echo_stops_by_itself_after_its_lifetime() -> None:
    proc = started("echo", "--port", str(free_port()), "--lifetime", "0.3")
    assert proc.wait(timeout=10) == 0


def test_a_sink_measures_what_a_blast_sends() -> None:
    port = free_port()
    sink = started("sink", "--port", str(port), "--idle", "0.3")
    assert sink.stdout is not None
    sent = run("blast", "--to", f"127.0.0.1:{port}", "--rate", "200000", "--duration", "0.5")
    got = json.loads(sink.stdout.readline())
    sink.wait(timeout=10)
    assert got["packets"] == sent["sent_packets"]  # loopback loses nothing
    assert got["ip_bytes"] == sent["sent_bytes"] + 28 * sent["sent_packets"]
    assert got["rate"] == pytest.approx(200_000 * 1228 / 1200, rel=0.25)


def test_a_bad_endpoint_is_a_usage_error() -> None:
    done = subprocess.run(
        [*PROBE, "ping", "--to", "nowhere"], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 2 and "'nowhere' is not HOST:PORT" in done.stderr
