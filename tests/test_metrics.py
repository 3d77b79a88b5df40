"""`GET /metrics`: the status document in Prometheus' text format, checked
with Prometheus' own parser (prometheus_client)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from runtime.api.metrics import prometheus_text

NODE = "ab" * 32
ODD_MODEL = 'qwen "3"\\8b\nnew'


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
        "demand": {ODD_MODEL: {"count": 9}},
        "coverage": {ODD_MODEL: {"layers": 8, "gaps": [[3, 5], [6, 7]]}},
        "drops": {"malformed_cbor": 2, "data.oversized": 1},
        "sessions": 1,
        "chat": {"completed": 5, "reroutes": 1},
        "hop": {
            "decode_steps": 40,
            "decode_compute_s": 0.125,
            "prefill_steps": 4,
            "prefill_tokens": 48,
            "prefill_compute_s": 0.5,
            "reaped": 0,
        },
        "admission": {"state": "admitted"},
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
    # The label value survives quotes, a backslash and a newline.
    assert got[("shardmesh_demand_requests_total", (("model", ODD_MODEL),))] == 9
    assert got[("shardmesh_coverage_gap_layers", (("model", ODD_MODEL),))] == 3
    assert got[("shardmesh_drops_total", (("reason", "data.oversized"),))] == 1
    assert got[("shardmesh_chat_completions_total", (("outcome", "failed"),))] == 0
    assert got[("shardmesh_hop_compute_seconds_total", (("phase", "prefill"),))] == 0.5
    assert got[("shardmesh_admission_state", (("state", "admitted"),))] == 1
    assert got[("shardmesh_admission_state", (("state", "failed"),))] == 0


def test_a_light_follower_has_no_shard_families_and_no_leader() -> None:
    text = prometheus_text(status(leader=None, hop=None, admission=None, chat={}))
    got = samples(text)
    assert got[("shardmesh_raft_has_leader", ())] == 0
    assert got[("shardmesh_raft_is_leader", ())] == 0
    assert "shardmesh_hop_" not in text and "shardmesh_admission_state" not in text
    # Each family is declared once, with its help and type.
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))
