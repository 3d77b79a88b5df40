"""`shardmesh voters list|add|refound`: each subcommand's own run function
and what it prints (the node's side: tests/processes/test_raft_trust.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime.cli import policy_client
from runtime.cli.main import main
from runtime.cli.policy_client import PolicyError

A, B = "a" * 64, "b" * 64
API = ("--api", "127.0.0.1:1")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    """What each subcommand asked the node for; the node's answers are canned."""
    asked: list[tuple[str, dict[str, Any]]] = []

    def answer(name: str, reply: dict[str, Any]) -> Any:
        def call(*args: Any, **kwargs: Any) -> dict[str, Any]:
            asked.append((name, {"args": args, **kwargs}))
            return reply

        return call

    voters = {"voters": [A], "learners": [], "eligible": [A, B], "eligibility_warning": "only 2"}
    monkeypatch.setattr(policy_client, "fetch_voters", answer("fetch_voters", voters))
    added = {"index": 7, "leader": A}
    monkeypatch.setattr(policy_client, "add_voter", answer("add_voter", added))
    refounded = {"voters": [B], "index": 9, "term": 4}
    monkeypatch.setattr(policy_client, "refound", answer("refound", refounded))
    monkeypatch.setenv("SHARDMESH_TOKEN", "t" * 43)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # no node's token here
    return asked


def test_list_shows_each_role(
    calls: list[tuple[str, dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["voters", "list", *API]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"voters    {A[:12]}",
        "learners  -",
        f"eligible  {A[:12]} {B[:12]}",
    ]
    assert err == "warning: only 2\n"
    assert main(["voters", "list", *API, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eligible"] == [A, B]
    assert [name for name, _ in calls] == ["fetch_voters", "fetch_voters"]


def test_add_and_refound_send_the_token_and_say_what_was_committed(
    calls: list[tuple[str, dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["voters", "add", B, *API, "--timeout", "3"]) == 0
    assert capsys.readouterr().out == (
        f"{B[:12]} may become a voter: committed at index 7 by leader {A[:12]}\n"
    )
    assert main(["voters", "refound", *API]) == 0
    assert capsys.readouterr().out == (
        f"refounded: {B[:12]} is the only voter (entry 9, term 4); the voter policy "
        "promotes eligible nodes from here\n"
    )
    (_, add), (_, refound) = calls
    assert add["args"] == ("http://127.0.0.1:1", B) and add["timeout"] == 3.0
    assert add["token"] is not None and refound["token"] is not None


def test_a_refusal_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise PolicyError("HTTP 409: a leader is alive")

    monkeypatch.setattr(policy_client, "fetch_voters", refused)
    assert main(["voters", "list", *API]) == 1
    assert capsys.readouterr().err == "shardmesh voters: error: HTTP 409: a leader is alive\n"
