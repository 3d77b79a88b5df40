"""`shardmesh invite`: the token on stdout, what it lets how many nodes do on
stderr (the node's side: tests/runtime/node/test_access.py and
tests/processes/test_private_swarm.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from runtime.cli import policy_client
from runtime.cli.main import main
from runtime.cli.policy_client import PolicyError


def test_the_invitation_is_printed_with_what_it_allows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: dict[str, Any] = {}
    expires_at = 2_000_000_000

    def request_invitation(api: str, **kwargs: Any) -> dict[str, Any]:
        asked.update(api=api, **kwargs)
        return {"invitation": "INVITE", "voter": True, "swarm": "c" * 64, "expires_at": expires_at}

    monkeypatch.setattr(policy_client, "request_invitation", request_invitation)
    (tmp_path / "operator.token").write_text("t" * 43 + "\n")
    argv = ["invite", "--api", "127.0.0.1:1", "--voter", "--expires", "30m"]
    assert main([*argv, "--state-dir", str(tmp_path)]) == 0
    assert (asked["api"], asked["voter"], asked["expires_s"], asked["uses"]) == (
        "http://127.0.0.1:1",
        True,
        1800.0,
        1,
    )
    out, err = capsys.readouterr()
    assert out == "INVITE\n"
    until = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(expires_at))
    assert err == (
        f"lets ONE node join swarm {'c' * 12} as a voter-eligible member, once, until {until}: "
        "shardmesh node --invite TOKEN ...\n"
    )


def test_uses_n_says_n_nodes_and_the_node_picks_the_default_life(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: dict[str, Any] = {}

    def request_invitation(api: str, **kwargs: Any) -> dict[str, Any]:
        asked.update(kwargs)
        return {"invitation": "I", "voter": False, "uses": 3, "swarm": "c" * 64, "expires_at": 0}

    monkeypatch.setattr(policy_client, "request_invitation", request_invitation)
    monkeypatch.setenv("SHARDMESH_TOKEN", "t" * 43)
    assert main(["invite", "--api", "127.0.0.1:1", "--uses", "3"]) == 0
    assert (asked["uses"], asked["expires_s"]) == (3, None)  # None: the node's default
    until = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(0))
    said = f"lets 3 nodes join swarm {'c' * 12} as members, each once, until {until}"
    assert capsys.readouterr().err.startswith(said)


@pytest.mark.parametrize("argv", [["--voter", "--uses", "2"], ["--uses", "0"]])
def test_a_voter_token_for_several_or_none_is_a_usage_error(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARDMESH_TOKEN", "t" * 43)
    with pytest.raises(SystemExit) as exited:
        main(["invite", "--api", "127.0.0.1:1", *argv])
    assert exited.value.code == 2 and "uses" in capsys.readouterr().err


def test_a_refusal_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise PolicyError("HTTP 409: this swarm is open")

    monkeypatch.setattr(policy_client, "request_invitation", refused)
    monkeypatch.setenv("SHARDMESH_TOKEN", "t" * 43)
    assert main(["invite", "--api", "127.0.0.1:1"]) == 1
    assert capsys.readouterr().err == "shardmesh invite: error: HTTP 409: this swarm is open\n"
