"""`GET /metrics`: the node's status in Prometheus' text exposition format (0.0.4).

Every figure is read from the document `GET /v1/network/status` returns, so
the two never disagree; this module only names and shapes them. Counters are
what only grows in the node's life or the swarm's (drops, steps, completions,
the ledger's demand counts); gauges are everything else. Labels are bounded
sets only: member states, tiers, drop reasons, outcomes, the swarm's models.
Latency histograms (`runtime.inference.latency`) come as cumulative buckets,
count and sum, and become `_bucket{le=...}` (`le="+Inf"`: the count), `_sum`
and `_count`. Each family: `# HELP`, `# TYPE`, then `name{label="value"}
number` lines; label values escape backslash, double quote and newline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mesh.member_table import MemberState

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
PREFIX: Final = "shardmesh_"
MEMBER_STATES: Final = tuple(str(state) for state in MemberState)  # in declaration order
TIERS: Final = ("operator", "bootstrap", "managed")
PHASES: Final = ("decode", "prefill")
ADMISSION_STATES: Final = ("checking", "admitted", "failed")


class _Exposition:
    """Families in the order first written, each with its samples."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[Mapping[str, str], float]],
    ) -> None:
        # Prometheus' convention: a counter's name ends in _total.
        full = PREFIX + name + ("_total" if kind == "counter" else "")
        self._lines.append(f"# HELP {full} {help_text}")
        self._lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            self._lines.append(f"{full}{_labels(labels)} {_number(value)}")

    def histogram(
        self,
        name: str,
        help_text: str,
        series: Iterable[tuple[Mapping[str, str], Mapping[str, Any]]],
    ) -> None:
        """One histogram family; each of `series` is its labels and a
        histogram as the status writes it (`Histogram.to_json`)."""
        full = PREFIX + name
        self._lines.append(f"# HELP {full} {help_text}")
        self._lines.append(f"# TYPE {full} histogram")
        for labels, histogram in series:
            buckets = [(repr(float(le)), n) for le, n in histogram["buckets"]]
            for le, count in [*buckets, ("+Inf", histogram["count"])]:
                bucket = _labels({**labels, "le": le})
                self._lines.append(f"{full}_bucket{bucket} {_number(count)}")
            self._lines.append(f"{full}_sum{_labels(labels)} {_number(histogram['sum'])}")
            self._lines.append(f"{full}_count{_labels(labels)} {_number(histogram['count'])}")

    def one(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.family(name, kind, help_text, [({}, value)])

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def prometheus_text(status: Mapping[str, Any]) -> str:
    """The exposition of one status document (see the module doc)."""
    out = _Exposition()
    _membership(out, status)
    _raft(out, status)
    _ledger(out, status)
    _drops_and_sessions(out, status)
    _chat(out, status.get("chat") or {})
    _verify(out, status.get("verify") or {})
    hop = status.get("hop")
    if hop is not None:
        _hop(out, hop)
    admission = status.get("admission")
    if admission is not None:
        out.family(
            "admission_state",
            "gauge",
            "1 for the state of this node's shard (doctor before routing).",
            [({"state": state}, float(admission["state"] == state)) for state in ADMISSION_STATES],
        )
    return out.text()


class StatusSource(Protocol):
    """Where the figures come from: the node's status document."""

    def status(self) -> dict[str, Any]: ...


class MetricsRoutes:
    """`GET /metrics`: `prometheus_text` of the node's status, read afresh."""

    def __init__(self, node: StatusSource) -> None:
        self.node = node

    def routes(self) -> list[Route]:
        return [Route("/metrics", self.metrics, methods=["GET"])]

    async def metrics(self, request: Request) -> Response:
        return Response(prometheus_text(self.node.status()), media_type=CONTENT_TYPE)


def _membership(out: _Exposition, status: Mapping[str, Any]) -> None:
    """This node's life and the members it knows."""
    out.one("uptime_seconds", "gauge", "Seconds since this node started.", status["uptime_s"])
    out.one("incarnation", "gauge", "This node's SWIM incarnation.", status["incarnation"])
    out.one("health_score", "gauge", "Lifeguard local health (0 is healthy).", status["health"])
    out.family(
        "members",
        "gauge",
        "Members this node knows, by the state it holds them in.",
        _counted("state", MEMBER_STATES, (member["state"] for member in status["members"])),
    )


def _raft(out: _Exposition, status: Mapping[str, Any]) -> None:
    """Raft as this node sees it: term, indexes, leader, voters."""
    raft = status.get("raft") or {}
    out.one("raft_term", "gauge", "Current Raft term.", status["term"])
    out.one("raft_commit_index", "gauge", "Highest committed log index.", status["commit_index"])
    out.one("raft_applied_index", "gauge", "Highest applied index.", raft.get("applied_index", 0))
    out.one(
        "raft_is_leader",
        "gauge",
        "1 when this node leads the placement ledger.",
        float(status["leader"] == status["node_id"]),
    )
    out.one(
        "raft_has_leader",
        "gauge",
        "1 when this node knows a leader with a quorum.",
        float(status["leader"] is not None),
    )
    out.one("raft_voters", "gauge", "Voters in the configuration.", len(raft.get("voters", [])))


def _ledger(out: _Exposition, status: Mapping[str, Any]) -> None:
    """The placement ledger: assignments, quarantines, demand, coverage."""
    out.family(
        "ledger_assignments",
        "gauge",
        "Live assignments in the placement ledger, by tier.",
        _counted("tier", TIERS, (entry["tier"] for entry in status["ledger"])),
    )
    out.one(
        "quarantined_nodes",
        "gauge",
        "Nodes the ledger holds quarantined now (proven wrong output or false reports).",
        len(status["quarantined"]),
    )
    out.family(
        "demand_requests",
        "counter",
        "Chat requests per model recorded in the ledger (swarm-wide).",
        [({"model": model}, entry["count"]) for model, entry in sorted(status["demand"].items())],
    )
    coverage = sorted(status["coverage"].items())
    out.family(
        "coverage_layers",
        "gauge",
        "Layers of each model the swarm knows.",
        [({"model": model}, entry["layers"]) for model, entry in coverage],
    )
    out.family(
        "coverage_gap_layers",
        "gauge",
        "Layers of each model no admitted node serves (0: routable).",
        [({"model": model}, _span_length(entry["gaps"])) for model, entry in coverage],
    )


def _drops_and_sessions(out: _Exposition, status: Mapping[str, Any]) -> None:
    out.family(
        "drops",
        "counter",
        "Inputs refused, by reason (malformed, forged, oversized, ...).",
        [({"reason": reason}, count) for reason, count in sorted(status["drops"].items())],
    )
    out.one("sessions", "gauge", "Inference sessions open on this node.", status["sessions"])


def _chat(out: _Exposition, chat: Mapping[str, Any]) -> None:
    """Chats this node answered as the entry, and their latency."""
    out.family(
        "chat_completions",
        "counter",
        "Chat completions this node answered as the entry, by outcome.",
        [({"outcome": outcome}, chat.get(outcome, 0)) for outcome in ("completed", "failed")],
    )
    out.one(
        "chat_reroutes",
        "counter",
        "Chains this entry re-routed after a hop failed mid-generation.",
        chat.get("reroutes", 0),
    )
    out.family(
        "chat_requests",
        "counter",
        "Chat requests this node answered as the entry, by how they ended "
        "(ok, client_error, rate_limited, model_not_found, model_loading, swarm_lost, ...).",
        [({"outcome": outcome}, count) for outcome, count in chat.get("requests", {}).items()],
    )
    for name, key, help_text in (
        ("chat_ttft_seconds", "ttft_s", "Seconds from accepting a chat to its first token."),
        ("chat_inter_token_seconds", "inter_token_s", "Seconds between two tokens of a chat."),
    ):
        if key in chat:
            out.histogram(name, help_text, [({}, chat[key])])


def _verify(out: _Exposition, verify: Mapping[str, Any]) -> None:
    """Spot checks as the entry, verdicts as the leader."""
    checks = {k: v for k, v in (verify.get("checks") or {}).items() if isinstance(v, int)}
    out.family(
        "spot_checks",
        "counter",
        "This entry's spot checks of finished requests, by what came of them "
        "(checked, clean, skipped, unchecked, reported, divergence.output, ...).",
        [({"result": result}, count) for result, count in sorted(checks.items())],
    )
    out.family(
        "verdicts",
        "counter",
        "Evidence this node judged as the leader, by outcome "
        "(guilty, false_report, undecided, no_independent_chain, ...).",
        [({"outcome": k}, v) for k, v in sorted((verify.get("verdicts") or {}).items())],
    )


def _hop(out: _Exposition, hop: Mapping[str, Any]) -> None:
    """The shard this node serves: steps, compute time, sessions."""
    for name, field, help_text in (
        ("hop_steps", "steps", "Forward steps this node's shard computed, by phase."),
        ("hop_compute_seconds", "compute_s", "Seconds this node's shard computed, by phase."),
    ):
        phases = [({"phase": phase}, hop[f"{phase}_{field}"]) for phase in PHASES]
        out.family(name, "counter", help_text, phases)
    out.one("hop_prefill_tokens", "counter", "Prompt tokens prefilled here.", hop["prefill_tokens"])
    out.one("hop_sessions_reaped", "counter", "Sessions closed as idle.", hop["reaped"])
    steps = hop.get("step_s")
    if steps is not None:
        out.histogram(
            "hop_step_seconds",
            "Seconds each forward step of this node's shard took, by phase.",
            [({"phase": phase}, steps[phase]) for phase in PHASES],
        )


def _counted(
    label: str, known: Iterable[str], values: Iterable[str]
) -> list[tuple[Mapping[str, str], float]]:
    """One sample per value of `label`: each known one (0 when absent), then
    any other seen, with how often it occurs in `values`."""
    counts = dict.fromkeys(known, 0)
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return [({label: value}, count) for value, count in counts.items()]


def _span_length(spans: Iterable[Iterable[int]]) -> int:
    return sum(end - start for start, end in spans)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    """Integers as integers; every figure in the status is finite."""
    return str(int(value)) if isinstance(value, int) else repr(float(value))
