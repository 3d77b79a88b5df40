"""The failover benchmark's pieces (`benchmarks.failover`): its quantile,
and how a survivor's answer ends a real trial. A simulated failover against
its target is in tests/simulations/test_raft_cluster.py; the 5-process
figure is the benchmark's own business (minutes)."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.failover import _committed_after, _quantile


def test_nearest_rank_quantiles() -> None:
    values = [float(v) for v in range(1, 201)]  # the benchmark's 200 runs
    assert _quantile(values, 0.5) == 100.0
    assert _quantile(values, 0.99) == 198.0
    assert _quantile(values, 1.0) == 200.0
    assert _quantile(values, 0.0) == 1.0
    assert _quantile([7.0], 0.9) == 7.0


def reply(status: int, body: object) -> httpx.Response:
    return httpx.Response(status, json=body)


def test_a_commit_in_a_newer_term_or_an_earlier_polls_copy_ends_the_trial() -> None:
    assert _committed_after(reply(200, {"term": 4}), old_term=3)
    assert not _committed_after(reply(200, {"term": 3}), old_term=3)
    already = {"error": {"code": "already_assigned", "message": "..."}}
    assert _committed_after(reply(409, already), old_term=3)
    assert not _committed_after(reply(503, {"error": {"code": "no_leader"}}), old_term=3)


def test_any_other_refusal_is_a_bug_in_the_benchmark() -> None:
    with pytest.raises(RuntimeError, match="refused the entry: 403"):
        _committed_after(reply(403, {"error": {"code": "forbidden"}}), old_term=3)
    with pytest.raises(RuntimeError, match="refused the entry: 409"):
        _committed_after(reply(409, {"error": {"code": "conflict"}}), old_term=3)
