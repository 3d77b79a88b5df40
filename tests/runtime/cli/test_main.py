"""The `shardmesh` command line: usage errors, `status`, start-up errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from runtime.cli.localswarm import LocalSwarm
from runtime.cli.main import main
from runtime.node.hostport import EndpointError, api_url, parse_hostport

CLI_TIMEOUT_S = 30.0


def shardmesh_command() -> list[str]:
    """The installed console script when there is one (what users run),
    else the module (same code)."""
    script = Path(sys.executable).with_name("shardmesh")
    return [str(script)] if script.exists() else [sys.executable, "-m", "runtime.cli"]


async def run_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(CLI_TIMEOUT_S):
        return await trio.run_process(
            [*shardmesh_command(), *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


# --- usage errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["node"], "--listen"),
        (["node", "--listen", "nonsense"], "is not HOST:PORT"),
        (["node", "--listen", "127.0.0.1:99999"], "out of range"),
        (["node", "--listen", "127.0.0.1:0", "--join", "127.0.0.1:7000"], "NODE_ID@HOST:PORT"),
        (["node", "--join", "ab@127.0.0.1:7000"], "not a node id"),
        (["node", "--join", f"{'a' * 64}@127.0.0.1:0"], "out of range"),
        (["node", "--listen", "127.0.0.1:0", "--profile", "fast"], "invalid choice: 'fast'"),
        (["node", "--listen", "0.0.0.0:7000"], "--advertise"),
        (["status"], "--api"),
        (["status", "--api", "localhost"], "is not HOST:PORT"),
        (["demo", "--nodes", "1"], "at least 2 nodes"),
        (["policy", "--api", "127.0.0.1:1", "--set", "nope=1"], "expected NAME=VALUE"),
        (["policy", "--api", "127.0.0.1:1", "--set", "idle_release_s"], "expected NAME=VALUE"),
        (["policy", "--api", "127.0.0.1:1", "--set", "max_copies=2.5"], "takes an integer"),
        (["policy", "--api", "127.0.0.1:1", "--set", "cooldown_s=soon"], "takes a number"),
    ],
)
def test_bad_arguments_exit_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys)


def assert_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], usage: str = "shardmesh"
) -> None:
    """`main(argv)` exits 2 printing `usage` (the command's) and `message`."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: {usage}" in err
    assert message in err


async def test_console_script_usage_error() -> None:
    result = await run_cli()
    assert result.returncode == 2
    assert b"usage: shardmesh" in result.stderr
    for command in (b"node", b"status", b"demo", b"simulate", b"tiny-model", b"doctor"):
        assert command in result.stderr


def test_endpoint_spellings() -> None:
    assert parse_hostport("tcp://127.0.0.1:7000").zmq() == "tcp://127.0.0.1:7000"
    assert parse_hostport("[::1]:7000").zmq() == "tcp://[::1]:7000"
    assert api_url("127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert api_url("http://node.example:8080/") == "http://node.example:8080"
    for bad in ("::1:7000", "host:", ":7000", "[::1]7000", "[nothex]:1"):
        with pytest.raises(EndpointError):
            parse_hostport(bad)


# --- status -----------------------------------------------------------------------


async def test_status_json_and_table_against_a_running_node(swarm: LocalSwarm) -> None:
    node = swarm.new_node()
    await swarm.start_ready(node)

    # Alone, the node founds a one-voter Raft cluster and leads it at once.
    await swarm.wait_for(
        [node], lambda views: (views[node.name] or {}).get("leader") == node.node_id, 5.0, "leader"
    )
    result = await run_cli("status", "--api", node.api, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["node_id"] == node.node_id
    for key in ("members", "leader", "term", "commit_index", "coverage", "ledger", "drops"):
        assert key in doc
    (me,) = doc["members"]
    assert me["node_id"] == node.node_id and me["state"] == "alive" and me["self"]

    # Without a scheme, and human-readable.
    result = await run_cli("status", "--api", node.api.removeprefix("http://"))
    assert result.returncode == 0, result.stderr
    text = result.stdout.decode()
    assert f"{node.node_id[:12]}*" in text
    assert "alive" in text
    assert node.info["control"] in text
    assert f"leader: {node.node_id[:12]} (term 1" in text
    assert "drops: none" in text


async def test_policy_shown_set_and_refused_against_a_running_node(swarm: LocalSwarm) -> None:
    node = swarm.new_node()
    await swarm.start_ready(node)

    shown = await run_cli("policy", "--api", node.api)
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.decode().splitlines()]
    assert ["idle_release_s", "1800.0", "default"] in rows and [
        "max_copies",
        "4",
        "default",
    ] in rows

    # One commit for both knobs (the CLI waits out the node's first election),
    # with the operator token from the node's state dir.
    token = ("--state-dir", str(node.state_dir))
    changed = await run_cli(
        "policy", "--api", node.api, *token, "--set", "cooldown_s=30", "--set", "max_copies=3",
        "--json",
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    answer = json.loads(changed.stdout)
    assert answer["accepted"] and answer["settings"] == {"cooldown_s": 30.0, "max_copies": 3}
    assert answer["policy"]["cooldown_s"] == 30.0 and answer["policy"]["max_copies"] == 3

    status = await run_cli("status", "--api", node.api)
    assert "policy: cooldown_s=30.0, max_copies=3 (the rest default" in status.stdout.decode()

    refused = await run_cli(
        "policy", "--api", node.api, *token, "--set", "max_admission_backoff_s=1"
    )
    assert refused.returncode == 1
    assert b"HTTP 400: admission_backoff_s (60.0) is above its ceiling" in refused.stderr


async def test_status_of_an_unreachable_node_exits_1(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:  # a port that is certainly closed: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        result = await run_cli("status", "--api", f"127.0.0.1:{port}", "--timeout", "2")
    assert result.returncode == 1
    assert b"cannot reach" in result.stderr


# --- node start-up errors ------------------------------------------------------


async def test_second_node_on_one_state_dir_or_port_exits_1(swarm: LocalSwarm) -> None:
    node = swarm.new_node()
    await swarm.start_ready(node)

    same_dir = await run_cli("node", "--listen", "127.0.0.1:0", "--state-dir", str(node.state_dir))
    assert same_dir.returncode == 1
    assert b"is in use by another shardmesh node" in same_dir.stderr

    other_dir = str(swarm.root / "other")
    same_port = await run_cli("node", "--listen", node.control, "--state-dir", other_dir)
    assert same_port.returncode == 1
    assert b"cannot listen on" in same_port.stderr

    api = node.api.removeprefix("http://")
    same_api = await run_cli(
        "node", "--listen", "127.0.0.1:0", "--api", api, "--state-dir", other_dir
    )
    assert same_api.returncode == 1
    assert b"cannot serve the API" in same_api.stderr
    assert node.running
