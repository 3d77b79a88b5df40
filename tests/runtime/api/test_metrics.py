"""`GET /metrics`: the status document in Prometheus' text format, checked
with Prometheus' own parser (prometheus_client); then (slow) the latency
histograms and request outcomes of a real node process after a few chats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from runtime.api.http import BadRequest
from runtime.api.metrics import CONTENT_TYPE, MetricsRoutes, prometheus_text
from runtime.api.openai import request_outcome
from runtime.cli.localswarm import LocalSwarm
from runtime.inference.chat import OUTCOMES, ChatError, parse_chat_request
from runtime.inference.latency import Histogram
from tests.swarm_helpers import start_tiny_model_node

NODE = "ab" * 32
ODD_MODEL = 'qwen "3"\\8b\nnew'


def histogram(bounds: tuple[float, ...], *values: float) -> dict[str, Any]:
    recorded = Histogram(bounds)
    for value in values:
        recorded.observe(value)
    return recorded.to_json()


def status(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "node_id": NODE,
        "uptime_s": 12.5,
        "incarnation": 3,
        "health": 0,
        "members": [
            {"state": "alive"},
            {"state": "alive"},
            {"state": "suspect"},
            {"state": "dead"},
        ],
        "leader": NODE,
        "term": 4,
        "commit_index": 17,
        "raft": {"applied_index": 16, "voters": ["x", "y", "z"]},
        "ledger": [{"tier": "operator"}, {"tier": "managed"}, {"tier": "managed"}],
        "quarantined": ["cd" * 32],
        "demand": {ODD_MODEL: {"count": 9}},
        "coverage": {ODD_MODEL: {"layers": 8, "gaps": [[3, 5], [6, 7]]}},
        "drops": {"malformed_cbor": 2, "data.oversized": 1},
        "sessions": 1,
        "chat": {
            "completed": 5,
            "reroutes": 1,
            "requests": dict.fromkeys(OUTCOMES, 0) | {"ok": 5, "rate_limited": 2},
            "ttft_s": histogram((0.1, 1.0), 0.05, 0.1, 0.5, 0.7, 3.0),
            "inter_token_s": histogram((0.01, 0.1), 0.002, 0.02),
        },
        "hop": {
            "decode_steps": 40,
            "decode_compute_s": 0.125,
            "prefill_steps": 4,
            "prefill_tokens": 48,
            "prefill_compute_s": 0.5,
            "reaped": 0,
            "step_s": {
                "decode": histogram((0.001, 0.01), *[0.003125] * 40),
                "prefill": histogram((0.001, 0.01), 0.125, 0.125, 0.125, 0.125),
            },
        },
        "admission": {"state": "admitted"},
        "verify": {
            "checks": {"checked": 3, "clean": 2, "reported": 1, "distrusted": ["ab" * 32]},
            "verdicts": {"guilty": 1, "false_report": 0},
        },
    }
    return base | overrides


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_every_figure_parses_back_as_the_status_says() -> None:
    got = samples(prometheus_text(status()))
    assert got[("shardmesh_members", (("state", "alive"),))] == 2
    assert got[("shardmesh_members", (("state", "left"),))] == 0  # every state, even at 0
    assert got[("shardmesh_raft_is_leader", ())] == 1
    assert got[("shardmesh_raft_term", ())] == 4 and got[("shardmesh_raft_voters", ())] == 3
    assert got[("shardmesh_ledger_assignments", (("tier", "managed"),))] == 2
    assert got[("shardmesh_quarantined_nodes", ())] == 1
    # The label value survives quotes, a backslash and a newline.
    assert got[("shardmesh_demand_requests_total", (("model", ODD_MODEL),))] == 9
    assert got[("shardmesh_coverage_gap_layers", (("model", ODD_MODEL),))] == 3
    assert got[("shardmesh_drops_total", (("reason", "data.oversized"),))] == 1
    assert got[("shardmesh_chat_completions_total", (("outcome", "failed"),))] == 0
    assert got[("shardmesh_hop_compute_seconds_total", (("phase", "prefill"),))] == 0.5
    assert got[("shardmesh_admission_state", (("state", "admitted"),))] == 1
    assert got[("shardmesh_admission_state", (("state", "failed"),))] == 0
    assert got[("shardmesh_chat_requests_total", (("outcome", "rate_limited"),))] == 2
    assert got[("shardmesh_chat_requests_total", (("outcome", "swarm_lost"),))] == 0
    assert got[("shardmesh_spot_checks_total", (("result", "reported"),))] == 1
    assert ("shardmesh_spot_checks_total", (("result", "distrusted"),)) not in got  # a list
    assert got[("shardmesh_verdicts_total", (("outcome", "guilty"),))] == 1


def test_latency_histograms_parse_back_cumulative_with_sum_and_count() -> None:
    text = prometheus_text(status())
    kinds = {family.name: family.type for family in text_string_to_metric_families(text)}
    for name in ("chat_ttft_seconds", "chat_inter_token_seconds", "hop_step_seconds"):
        assert kinds["shardmesh_" + name] == "histogram"
    got = samples(text)
    ttft = "shardmesh_chat_ttft_seconds"
    # 0.05 and 0.1 (on the bound) <= 0.1; and 0.5, 0.7 <= 1; and 3.0 above every bound.
    assert [got[(ttft + "_bucket", (("le", le),))] for le in ("0.1", "1.0", "+Inf")] == [2, 4, 5]
    assert got[(ttft + "_count", ())] == 5 and got[(ttft + "_sum", ())] == 4.35
    assert got[("shardmesh_chat_inter_token_seconds_count", ())] == 2
    step = "shardmesh_hop_step_seconds"
    decode, prefill = (("phase", "decode"),), (("phase", "prefill"),)
    assert got[(step + "_bucket", (("le", "0.001"), *decode))] == 0
    assert got[(step + "_bucket", (("le", "0.01"), *decode))] == 40
    assert got[(step + "_count", decode)] == 40 and got[(step + "_sum", decode)] == 0.125
    assert got[(step + "_bucket", (("le", "+Inf"), *prefill))] == 4
    assert got[(step + "_count", prefill)] == 4 and got[(step + "_sum", prefill)] == 0.5


def test_each_refusal_is_counted_by_its_reason() -> None:
    with pytest.raises(ChatError) as bad_field:
        parse_chat_request({"model": "m", "messages": []})
    assert request_outcome(bad_field.value) == "client_error"
    assert request_outcome(BadRequest("malformed JSON body")) == "client_error"
    assert request_outcome(HTTPException(415)) == "client_error"
    assert request_outcome(ChatError(429, "busy", code="rate_limit_exceeded")) == "rate_limited"
    assert request_outcome(ChatError(404, "no", code="model_not_found")) == "model_not_found"
    assert request_outcome(ChatError(503, "wait", code="model_loading")) == "model_loading"
    assert request_outcome(ChatError(503, "lost", code="generation_failed")) == "swarm_lost"
    assert request_outcome(RuntimeError("a bug")) == "server_error"
    assert set(OUTCOMES) >= {"ok", "cancelled"}


def test_a_light_follower_has_no_shard_families_and_no_leader() -> None:
    text = prometheus_text(status(leader=None, hop=None, admission=None, chat={}))
    got = samples(text)
    assert got[("shardmesh_raft_has_leader", ())] == 0
    assert got[("shardmesh_raft_is_leader", ())] == 0
    assert "shardmesh_hop_" not in text and "shardmesh_admission_state" not in text
    assert "shardmesh_chat_ttft_seconds_bucket" not in text  # none in the document: none here
    # Each family is declared once, with its help and type.
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))


# --- a real node process ---------------------------------------------------------------

MODEL = "tiny"
CHATS = ((5, False), (9, False), (7, True))
"""(max_tokens, stream) of each chat that is answered."""


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return samples(response.text)


async def answer(client: httpx.AsyncClient, max_tokens: int, stream: bool) -> tuple[int, str]:
    """One chat to the end: (completion tokens, finish reason)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the swarm of volunteers."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        completion = response.json()
        return completion["usage"]["completion_tokens"], completion["choices"][0]["finish_reason"]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return chunks[-1]["usage"]["completion_tokens"], next(f for f in finish if f)


class StatusOf:
    """A node as `MetricsRoutes` reads it: its status document, read afresh."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.reads = 0

    def status(self) -> dict[str, Any]:
        self.reads += 1
        return self.document


async def test_get_metrics_serves_the_status_read_afresh() -> None:
    node = StatusOf(status())
    app = Starlette(routes=MetricsRoutes(node).routes())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        first = await client.get("/metrics")
        assert first.status_code == 200
        assert first.headers["content-type"] == CONTENT_TYPE
        assert first.text == prometheus_text(status())
        node.document = status(sessions=7)
        second = await client.get("/metrics")
    assert node.reads == 2
    families = {f.name: f for f in text_string_to_metric_families(second.text)}
    assert families["shardmesh_sessions"].samples[0].value == 7


@pytest.mark.slow
async def test_a_serving_node_reports_latency_and_outcomes(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    node = await start_tiny_model_node(swarm, tmp_path, MODEL)
    async with httpx.AsyncClient(base_url=node.api, timeout=60) as client:
        answered = [await answer(client, max_tokens, stream) for max_tokens, stream in CHATS]
        refused = await client.post("/v1/chat/completions", json={"model": MODEL})
        assert refused.status_code == 400
        unknown = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/chat/completions", json=unknown)).status_code == 404
        # A stream is counted once its response is over, just after its last byte.
        with trio.fail_after(5):
            while (got := await scrape(client))[
                ("shardmesh_chat_requests_total", (("outcome", "ok"),))
            ] < len(CHATS):
                await trio.sleep(0.05)

    def outcome(name: str) -> float:
        return got[("shardmesh_chat_requests_total", (("outcome", name),))]

    assert [outcome(name) for name in OUTCOMES] == [3, 1, 0, 1, 0, 0, 0, 0]
    # A token each chat: the first's wait goes to time to first token, every later one's
    # to the time since the token before.
    tokens = sum(count for count, _ in answered)
    assert got[("shardmesh_chat_ttft_seconds_count", ())] == len(CHATS)
    assert got[("shardmesh_chat_inter_token_seconds_count", ())] == tokens - len(CHATS)
    for name in ("chat_ttft_seconds", "chat_inter_token_seconds"):
        buckets = sorted(
            (float(dict(labels)["le"]), value)
            for (sample, labels), value in got.items()
            if sample == f"shardmesh_{name}_bucket"
        )
        counts = [value for _, value in buckets]
        assert counts == sorted(counts)  # cumulative
        assert counts[-1] == got[(f"shardmesh_{name}_count", ())]
        assert got[(f"shardmesh_{name}_sum", ())] > 0
    # The node is the whole chain: the prompt is one prefill step, each later token
    # one decode step (and a chat that stopped early may have sent one more).
    step = "shardmesh_hop_step_seconds_count"
    prefill, decode = got[(step, (("phase", "prefill"),))], got[(step, (("phase", "decode"),))]
    assert prefill == len(CHATS)
    stopped = sum(1 for _, finish in answered if finish == "stop")
    assert tokens - len(CHATS) <= decode <= tokens - len(CHATS) + stopped
    for phase, count in (("prefill", prefill), ("decode", decode)):
        assert got[("shardmesh_hop_steps_total", (("phase", phase),))] == count
