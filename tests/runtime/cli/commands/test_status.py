"""`shardmesh status` against a running node, an unreachable one, and bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.cli.localswarm import LocalSwarm
from tests.runtime.cli.test_main import assert_usage_error, run_cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["status"], "--api"),
        (["status", "--api", "localhost"], "is not HOST:PORT"),
    ],
)
def test_bad_arguments_exit_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys)


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


async def test_status_of_an_unreachable_node_exits_1(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:  # a port that is certainly closed: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        result = await run_cli("status", "--api", f"127.0.0.1:{port}", "--timeout", "2")
    assert result.returncode == 1
    assert b"cannot reach" in result.stderr
