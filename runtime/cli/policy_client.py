"""`shardmesh policy`, `voters` and `invite`: the admin calls about the swarm.

`policy` shows the swarm's placement policy, or changes it; `voters` shows
who votes and who may, or makes a node eligible to vote; `invite` asks a
voter for an invitation to a private swarm.

The policy's knobs (`consensus.settings`) are one set for the whole swarm,
committed in the placement ledger, so any node can be asked: it shows its
replica of them, and forwards a change to the Raft leader, which commits it
for every node. A change needs a leader with a quorum; while an election
runs the node answers 503, and this client asks again until its deadline.
Showing the policy is public; a change needs the node's operator token
(`runtime.cli.operator_token`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final

import httpx

from consensus.settings import POLICY_FIELDS
from runtime.cli.operator_token import OperatorToken

POLICY_PATH: Final = "/v1/network/policy"
INVITE_PATH: Final = "/v1/network/invitations"
VOTERS_PATH: Final = "/v1/network/voters"
REFOUND_PATH: Final = "/v1/network/refound"
INVITE_TIMEOUT_S: Final = 10.0
RETRY_S: Final = 0.5
"""Pause between asks while the swarm has no leader (an election takes
well under a second on a LAN; this keeps a waiting client cheap)."""


class PolicyError(Exception):
    """The node could not be reached, or refused the change."""


def parse_setting(text: str) -> tuple[str, int | float]:
    """`NAME=VALUE` as a knob and its number (argparse `type=`); ValueError
    names what is wrong."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or name not in POLICY_FIELDS:
        raise ValueError(f"expected NAME=VALUE with NAME one of {', '.join(POLICY_FIELDS)}")
    try:
        number = POLICY_FIELDS[name](value)
    except ValueError:
        kind = "an integer" if POLICY_FIELDS[name] is int else "a number"
        raise ValueError(f"{name} takes {kind}, got {value!r}") from None
    return name, number


def fetch_policy(api: str, *, timeout: float) -> dict[str, Any]:
    """The node's replica of the swarm's policy: {"policy", "settings"}."""
    return _answer(_request("GET", api, None, timeout))


def set_policy(
    api: str, settings: Mapping[str, int | float], *, token: OperatorToken, timeout: float
) -> dict[str, Any]:
    """Commit `settings` swarm-wide with the operator's `token`; the
    leader's answer (with "policy", the whole policy now in force)."""
    return _commit(api, POLICY_PATH, dict(settings), token, timeout)


def fetch_voters(api: str, *, timeout: float) -> dict[str, Any]:
    """{"voters", "learners", "eligible", "eligibility_warning"} as the node sees them."""
    return _answer(_request("GET", api, None, timeout, path=VOTERS_PATH))


def add_voter(api: str, node_id: str, *, token: OperatorToken, timeout: float) -> dict[str, Any]:
    """Commit that `node_id` may become a voter; the leader's answer."""
    return _commit(api, VOTERS_PATH, {"node_id": node_id}, token, timeout)


def refound(api: str, *, token: OperatorToken, timeout: float) -> dict[str, Any]:
    """Make the node at `api` the only voter; its answer (the new voters)."""
    response = _request("POST", api, {}, timeout, token.headers(), REFOUND_PATH)
    if response.status_code == 401:
        raise PolicyError(token.refused())
    return _answer(response)


def _commit(
    api: str, path: str, body: dict[str, Any], token: OperatorToken, timeout: float
) -> dict[str, Any]:
    """POST a change the leader commits; ask again while there is no leader
    (503) until `timeout`; PolicyError unless the ledger accepted it."""
    deadline = time.monotonic() + timeout
    while True:
        response = _request("POST", api, body, timeout, token.headers(), path)
        if response.status_code != 503 or time.monotonic() + RETRY_S > deadline:
            break
        time.sleep(RETRY_S)
    if response.status_code == 401:
        raise PolicyError(token.refused())
    answer = _answer(response)
    if not answer.get("accepted"):
        raise PolicyError(f"the ledger refused it: {answer.get('reason')}: {answer.get('detail')}")
    return answer


def request_invitation(
    api: str, *, voter: bool, expires_s: float | None, token: OperatorToken, uses: int = 1
) -> dict[str, Any]:
    """An invitation signed by the node at `api` (a voter of a private
    swarm) for `uses` nodes, redeemable for `expires_s` (None: the node's
    default for the role): {"invitation", "swarm", "voter", "uses", "expires_at"}."""
    body: dict[str, Any] = {"voter": voter, "uses": uses}
    if expires_s is not None:
        body["expires_s"] = expires_s
    response = _request("POST", api, body, INVITE_TIMEOUT_S, token.headers(), INVITE_PATH)
    if response.status_code == 401:
        raise PolicyError(token.refused())
    return _answer(response)


def render_policy(policy: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """One line per knob: its value, and whether the swarm set it."""
    width = max(len(name) for name in POLICY_FIELDS)
    return "\n".join(
        f"{name:<{width}}  {policy.get(name)!s:>10}  {'set' if name in settings else 'default'}"
        for name in POLICY_FIELDS
    )


def _request(
    method: str,
    api: str,
    body: dict[str, Any] | None,
    timeout: float,
    headers: Mapping[str, str] | None = None,
    path: str = POLICY_PATH,
) -> httpx.Response:
    url = api.rstrip("/") + path
    try:
        return httpx.request(method, url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise PolicyError(f"cannot reach {url}: {exc}") from exc


def _answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a 200, or PolicyError with the node's message."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        raise PolicyError(f"HTTP {response.status_code}: {error['message']}")
    raise PolicyError(f"HTTP {response.status_code}: {response.text[:300]}")
