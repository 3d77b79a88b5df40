"""`shardmesh lab` as a user runs it: real subprocesses, real namespaces
(root; those tests skip elsewhere, saying why)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.lab.check import RTT_TOLERANCE_MS
from runtime.lab.netns import leftovers, namespaces
from runtime.lab.topology import load_topology
from tests.runtime.lab.fixtures import skip_without_lab

SHARDMESH = [sys.executable, "-m", "runtime.cli"]
TIMEOUT_S = 60
SMALL = {"link": {"delay_ms": 10}, "sites": [{"name": "a"}, {"name": "b"}]}


def lab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SHARDMESH, "lab", *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def spec_file(tmp_path: Path, spec: object) -> str:
    path = tmp_path / "lab.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return str(path)


def up(spec: str, *flags: str) -> tuple[subprocess.Popen[str], dict[str, object]]:
    proc = subprocess.Popen(
        [*SHARDMESH, "lab", "up", spec, "--json", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(TIMEOUT_S)
        pytest.fail(f"lab up said nothing: {proc.stderr.read() if proc.stderr else ''}")
    return proc, json.loads(line)


def test_check_prints_json_with_the_rtt_error(tmp_path: Path) -> None:
    skip_without_lab()
    done = lab("check", spec_file(tmp_path, SMALL), "--count", "50")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    print(f"lab check: RTT error {report['rtt_error_ms']} ms")
    assert report["ok"] and report["pairs"][0]["configured_rtt_ms"] == 40
    assert 0 <= report["rtt_error_ms"] <= RTT_TOLERANCE_MS
    assert report["delayer_priority"].startswith("SCHED_FIFO")
    assert leftovers(report["prefix"]) == []


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_up_builds_until_a_signal_then_removes_the_lab(tmp_path: Path, stop: int) -> None:
    skip_without_lab()
    proc, document = up(spec_file(tmp_path, SMALL))
    try:
        sites = {site["name"]: site for site in document["sites"]}  # type: ignore[attr-defined]
        a_ns = sites["a"]["namespace"]
        assert a_ns in namespaces()
        addresses = subprocess.run(
            ["ip", "netns", "exec", a_ns, "ip", "-o", "-4", "addr"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        assert f"inet {sites['a']['address']}/24" in addresses
    finally:
        proc.send_signal(stop)
        assert proc.wait(TIMEOUT_S) == 0
    assert leftovers(str(document["prefix"])) == []


def test_up_for_a_while_removes_the_lab_by_itself(tmp_path: Path) -> None:
    skip_without_lab()
    proc, document = up(spec_file(tmp_path, SMALL), "--for", "0.5")
    assert proc.wait(TIMEOUT_S) == 0
    assert leftovers(str(document["prefix"])) == []


def test_down_removes_what_a_killed_up_left(tmp_path: Path) -> None:
    skip_without_lab()
    proc, document = up(spec_file(tmp_path, SMALL))
    proc.kill()
    proc.wait(TIMEOUT_S)
    prefix = str(document["prefix"])
    left = leftovers(prefix)
    assert f"{prefix}-core" in left
    done = lab("down", prefix)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [word for name in left for word in ("removed", name)]
    assert leftovers(prefix) == []
    assert lab("down", prefix).stdout.strip() == "no lab namespaces to remove"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "lab.json: not JSON: Expecting property name"),
        ('{"sites": [{"name": "a", "loss": 2}]}', "sites[0] ('a'): loss: 2 is outside"),
        (None, "cannot read"),
    ],
)
def test_a_bad_spec_is_one_line(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "lab.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    for command in ("up", "check"):
        done = lab(command, str(path))
        assert done.returncode == 1
        assert done.stderr.startswith(f"shardmesh lab {command}: error: ")
        assert message in done.stderr and done.stderr.count("\n") == 1


def test_example_prints_a_spec_that_loads() -> None:
    done = lab("example")
    assert done.returncode == 0
    topology = load_topology(json.loads(done.stdout))
    assert [site.nat for site in topology.sites] == ["none", "none", "port-preserving"]


def test_up_removes_the_lab_when_its_delayer_dies(tmp_path: Path) -> None:
    skip_without_lab()
    proc, document = up(spec_file(tmp_path, SMALL))
    core = f"{document['prefix']}-core"
    pids = subprocess.run(
        ["ip", "netns", "pids", core], capture_output=True, text=True, timeout=10, check=True
    ).stdout.split()
    for pid in pids:  # the delayer is all that runs in the core
        os.kill(int(pid), signal.SIGKILL)
    assert proc.wait(TIMEOUT_S) == 1
    assert proc.stderr is not None and "the delayer stopped" in proc.stderr.read()
    assert leftovers(str(document["prefix"])) == []
