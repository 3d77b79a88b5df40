"""The admin calls' client (`runtime.cli.policy_client`) against a real node's routes.

A one-voter node leading on a real Raft driver (tests/runtime/api/inprocess.py)
serves its network routes with hypercorn on loopback; the client's blocking
calls run in a worker thread of the test's trio run. Each call is checked for
what it commits or shows, and each refusal for the one line it turns into:
a wrong token, the ledger's no, a node that is not there, and a swarm without
a leader that the client asks again until its deadline.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from consensus.settings import POLICY_FIELDS, PlacementSettings, policy_json
from mesh.identity import Identity, node_id_text
from runtime.cli import policy_client
from runtime.cli.operator_token import OperatorToken
from runtime.cli.policy_client import (
    PolicyError,
    add_voter,
    fetch_policy,
    fetch_voters,
    parse_setting,
    refound,
    render_policy,
    request_invitation,
    set_policy,
)
from tests.runtime.api.inprocess import TOKEN, FollowerRaft, leading_node, make_node, served

OPERATOR = OperatorToken(TOKEN, "test")
WRONG = OperatorToken("not-this-nodes-token", "--token-file wrong")


async def in_thread(call: Any, *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: call(*args, **kwargs))


def test_a_setting_is_name_equals_a_number_of_the_knobs_type() -> None:
    assert parse_setting("max_copies=3") == ("max_copies", 3)
    assert parse_setting(" idle_release_s=600") == ("idle_release_s", 600.0)
    assert isinstance(parse_setting("idle_release_s=600")[1], float)
    with pytest.raises(ValueError, match=r"max_copies takes an integer, got '2\.5'"):
        parse_setting("max_copies=2.5")
    with pytest.raises(ValueError, match="idle_release_s takes a number, got 'soon'"):
        parse_setting("idle_release_s=soon")
    for bad in ("max_copies", "no_such_knob=1", "=1"):
        with pytest.raises(
            ValueError,
            match=re.escape(f"expected NAME=VALUE with NAME one of {', '.join(POLICY_FIELDS)}"),
        ):
            parse_setting(bad)


def test_the_policy_is_one_line_per_knob_saying_whether_the_swarm_set_it() -> None:
    policy = policy_json(PlacementSettings(max_copies=7))
    lines = render_policy(policy, {"max_copies": 7}).splitlines()
    assert [line.split()[0] for line in lines] == list(POLICY_FIELDS)
    by_name = {line.split()[0]: line.split()[1:] for line in lines}
    assert by_name["max_copies"] == ["7", "set"]
    assert by_name["idle_release_s"] == [str(PlacementSettings().idle_release_s), "default"]


async def test_the_policy_is_shown_and_changed_swarm_wide_with_the_token(tmp_path: Path) -> None:
    async with leading_node(tmp_path) as node, served(node) as url:
        shown = await in_thread(fetch_policy, url, timeout=5.0)
        assert shown == {"policy": policy_json(PlacementSettings()), "settings": {}}
        answer = await in_thread(set_policy, url, {"max_copies": 2}, token=OPERATOR, timeout=5.0)
        assert answer["accepted"] and answer["leader"] == node_id_text(node.node_id)
        assert answer["policy"]["max_copies"] == 2
        assert node.raft.ledger.policy_settings() == {"max_copies": 2}
        assert (await in_thread(fetch_policy, url + "/", timeout=5.0))["settings"] == {
            "max_copies": 2
        }
        with pytest.raises(PolicyError, match="refused the operator token from --token-file"):
            await in_thread(set_policy, url, {"max_copies": 3}, token=WRONG, timeout=5.0)
        with pytest.raises(PolicyError, match=r"HTTP 400: .*max_copies"):
            await in_thread(set_policy, url, {"max_copies": -1}, token=OPERATOR, timeout=5.0)
    assert node.raft.ledger.policy_settings() == {"max_copies": 2}


async def test_voters_are_shown_and_made_eligible_and_refound_is_refused(tmp_path: Path) -> None:
    newcomer = node_id_text(Identity.generate().node_id)
    async with leading_node(tmp_path) as node, served(node) as url:
        voters = await in_thread(fetch_voters, url, timeout=5.0)
        assert voters["voters"] == [node_id_text(node.node_id)]
        added = await in_thread(add_voter, url, newcomer, token=OPERATOR, timeout=5.0)
        assert added["accepted"]
        assert newcomer in (await in_thread(fetch_voters, url, timeout=5.0))["eligible"]
        with pytest.raises(PolicyError, match="refused the operator token"):
            await in_thread(add_voter, url, newcomer, token=WRONG, timeout=5.0)
        # A leader with its quorum is no swarm to refound: the node's 409, in one line.
        with pytest.raises(PolicyError, match="HTTP 409: "):
            await in_thread(refound, url, token=OPERATOR, timeout=5.0)
        with pytest.raises(PolicyError, match="refused the operator token"):
            await in_thread(refound, url, token=WRONG, timeout=5.0)
        with pytest.raises(PolicyError, match=r"HTTP 409: .*open"):
            await in_thread(request_invitation, url, voter=False, expires_s=60.0, token=OPERATOR)


async def test_the_ledgers_refusal_is_an_error_naming_its_reason(tmp_path: Path) -> None:
    newcomer = node_id_text(Identity.generate().node_id)
    async with leading_node(tmp_path) as node, served(node) as url:
        assert (await in_thread(add_voter, url, newcomer, token=OPERATOR, timeout=5.0))["accepted"]
        # Committed, and refused by the ledger: the node may become a voter already.
        with pytest.raises(PolicyError, match=r"the ledger refused it: .*voter already"):
            await in_thread(add_voter, url, newcomer, token=OPERATOR, timeout=5.0)
    assert node_id_text(node.node_id) in node.raft.voters_view()["voters"]


async def test_without_a_leader_the_change_is_asked_again_until_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy_client, "RETRY_S", 0.05)
    async with leading_node(tmp_path) as node:
        follower = make_node(node.raft, Identity.generate())
        follower.raft = FollowerRaft(follower.node_id, None)  # type: ignore[assignment]
        async with served(follower) as url:
            started = time.monotonic()
            with pytest.raises(PolicyError, match="HTTP 503: "):
                await in_thread(set_policy, url, {"max_copies": 2}, token=OPERATOR, timeout=0.5)
            waited = time.monotonic() - started
    assert 0.4 <= waited < 3.0  # asked until the deadline, then gave up


async def test_a_node_that_is_not_there_is_an_error_naming_the_url() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(PolicyError, match=f"cannot reach {url}/v1/network/policy"):
            await in_thread(fetch_policy, url, timeout=2.0)
        with pytest.raises(PolicyError, match=f"cannot reach {url}/v1/network/voters"):
            await in_thread(fetch_voters, url, timeout=2.0)
