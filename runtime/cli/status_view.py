"""`shardmesh status`: fetch a node's `/v1/network/status` and show it.

The table is for people (short ids, states, how long since each member was
last heard from, the drop counters); `--json` prints the raw document for
scripts. The formatting functions take the JSON document, so the demo prints
exactly what `shardmesh status` would.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx

SHORT_ID = 12
STATUS_PATH = "/v1/network/status"


class StatusError(Exception):
    """The node could not be reached or did not answer with a status."""


def fetch_status(base_url: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """GET the status document from the node at `base_url`."""
    url = base_url.rstrip("/") + STATUS_PATH
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach {url}: {exc}") from exc
    if response.status_code != 200:
        raise StatusError(f"{url} answered {response.status_code}: {response.text[:300]}")
    try:
        body = response.json()
    except json.JSONDecodeError as exc:
        raise StatusError(f"{url} did not answer JSON: {exc}") from exc
    if not isinstance(body, dict) or "members" not in body:
        raise StatusError(f"{url} did not answer a network status document")
    return body


def short(node_id: str | None) -> str:
    return "-" if not node_id else node_id[:SHORT_ID]


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s ago"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    return f"{seconds / 60:.0f}m ago"


def format_members(status: dict[str, Any]) -> list[str]:
    """The member table, one line per member, self marked with `*`."""
    rows = [("NODE", "STATE", "INC", "ADDR", "LAST SEEN")]
    for member in status.get("members", []):
        mark = "*" if member.get("self") else " "
        rows.append(
            (
                short(member.get("node_id")) + mark,
                str(member.get("state", "?")),
                str(member.get("incarnation", "?")),
                str(member.get("addr", "-")),
                "self" if member.get("self") else _ago(member.get("last_seen")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if i == 2 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_drops(drops: dict[str, int]) -> str:
    if not drops:
        return "drops: none"
    return "drops: " + ", ".join(f"{reason}={count}" for reason, count in sorted(drops.items()))


def summary_line(status: dict[str, Any]) -> str:
    states = Counter(str(m.get("state")) for m in status.get("members", []))
    counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "none"
    return (
        f"node {short(status.get('node_id'))} (incarnation {status.get('incarnation')}, "
        f"profile {status.get('profile', '?')}): {len(status.get('members', []))} members: "
        f"{counts}"
    )


RECENT_DECISIONS_SHOWN = 5


def _spans(spans: list[list[int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in spans) or "none"


def format_leaderless(status: dict[str, Any]) -> list[str]:
    """Why no leader is named, and what to do (`leadership`, from
    `runtime.node.leadership`): nothing while one is."""
    leadership = status.get("leadership") or {}
    if leadership.get("state") != "leaderless":
        return []
    return [f"  {key}: {leadership[key]}" for key in ("why", "fix") if leadership.get(key)]


def format_status(status: dict[str, Any]) -> str:
    """The whole human-readable report."""
    leader = status.get("leader")
    lines = [summary_line(status)]
    reachability = status.get("reachability") or {}
    if reachability.get("says"):
        lines.append(f"reachability: {reachability['says']}")
    lines += ["", *format_members(status), ""]
    lines.append(
        f"leader: {short(leader) if leader else 'none'} "
        f"(term {status.get('term', 0)}, commit index {status.get('commit_index', 0)})"
    )
    lines += format_leaderless(status)
    for model, entry in sorted((status.get("coverage") or {}).items()):
        lines.append(
            f"coverage: {model} ({entry.get('layers')} layers): covered "
            f"{_spans(entry.get('covered', []))}; gaps {_spans(entry.get('gaps', []))}"
        )
    raft = status.get("raft") or {}
    if raft:
        voters = ", ".join(short(v) for v in raft.get("voters", [])) or "none"
        learners = ", ".join(short(n) for n in raft.get("learners", [])) or "none"
        lines.append(f"raft: {raft.get('role', '?')}; voters {voters}; learners {learners}")
    for entry in status.get("ledger", []):
        a, b = entry.get("layers", ["?", "?"])
        lines.append(
            f"assignment: {short(entry.get('node_id'))} {entry.get('model')} [{a}, {b}) "
            f"{entry.get('recipe')} tier {entry.get('tier')} managed={entry.get('managed')} "
            f"(epoch {entry.get('epoch')})"
        )
    placement = status.get("placement") or {}
    waiting = {m: code for m, code in (placement.get("waiting") or {}).items() if code != "serving"}
    if waiting:
        lines.append(
            "waiting: " + ", ".join(f"{model} ({code})" for model, code in sorted(waiting.items()))
        )
    for decision in (placement.get("decisions") or [])[-RECENT_DECISIONS_SHOWN:]:
        where = f" on {short(decision['node_id'])}" if decision.get("node_id") else ""
        layers = decision.get("layers")
        span = f" [{layers[0]}, {layers[1]})" if layers else ""
        lines.append(
            f"placed: {decision['command']} {decision.get('model')}{span}{where}: "
            f"{decision['code']} ({decision['reason']})"
        )
    demand = status.get("demand") or {}
    if demand:
        lines.append(
            "demand: "
            + ", ".join(f"{model}={d.get('count')}" for model, d in sorted(demand.items()))
        )
    settings = status.get("policy_settings") or {}
    if settings:
        knobs = ", ".join(f"{name}={value}" for name, value in sorted(settings.items()))
        lines.append(f"policy: {knobs} (the rest default; see `shardmesh policy`)")
    lines.append(f"sessions: {status.get('sessions', 0)}{batching_text(status)}")
    lines.append(format_drops(status.get("drops", {})))
    return "\n".join(lines)


def batching_text(status: dict[str, Any]) -> str:
    """How full this hop's batched decode steps ran, once it ran any
    (docs/design/batching.md): `; decode batches: 12, 3.4 rows on average,
    at most 8`."""
    batching = (status.get("hop") or {}).get("batching") or {}
    if not batching.get("batches"):
        return ""
    return (
        f"; decode batches: {batching['batches']}, {batching['mean_rows']:g} rows on average, "
        f"at most {batching['largest']}"
    )


def render(status: dict[str, Any], *, as_json: bool) -> str:
    return json.dumps(status, indent=2, sort_keys=True) if as_json else format_status(status)
