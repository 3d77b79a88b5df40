"""`shardmesh policy`: shown, set and refused against a running node; bad settings."""

from __future__ import annotations

import json

import pytest

from runtime.cli.localswarm import LocalSwarm
from tests.runtime.cli.test_main import assert_usage_error, run_cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
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
