"""`benchmarks.concurrency --quick` runs its real swarm (three node processes
of the tiny model on loopback) and reports what the issue's run reports:
aggregates, inter-token times, each hop's batches and the ceiling."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.concurrency import QUICK_COUNTS, hop_figures, stream_figures

QUICK_TIMEOUT_S = 180
"""About 10 s on an idle 2-core machine; generous for a loaded one."""


def test_quick_run_batches_streams_and_reports_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.concurrency", "--quick", "--json"],
        capture_output=True, text=True, timeout=QUICK_TIMEOUT_S, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("aggregate_4_vs_1", "aggregate_4_vs_transformers", "itl_p50_4_vs_1"):
        assert result[key] > 0, key
    runs = result["models"]["tiny"]["torch"]
    assert [run["streams"] for run in runs] == list(QUICK_COUNTS)
    for run in runs:
        assert run["aggregate_tok_s"] > 0 and run["transformers_tok_s"] > 0
        assert 0 < run["itl_p50_ms"] <= run["itl_p99_ms"]
        assert len(run["hops"]) == result["hops"] == 3
        assert run["tokens"] == [result["tokens_per_stream"]] * run["streams"]
    four = runs[-1]["hops"]
    assert all(hop["batches"] > 0 and hop["rows"] >= hop["batches"] for hop in four)
    assert any(hop["largest"] >= 2 for hop in four), four  # steps of streams ran together


def test_figures_from_arrival_times_and_counters() -> None:
    streams = [
        {"arrivals": [0.0, 0.1, 0.2], "tokens": 3},
        {"arrivals": [0.1, 0.3, 0.5], "tokens": 3},
    ]
    figures = stream_figures(streams)
    assert figures["aggregate_tok_s"] == 4 / 0.5
    assert figures["itl_p50_ms"] == 150.0 and figures["itl_p99_ms"] == 200.0
    before = [{"batches": 2, "rows": 2, "sizes": {"1": 2}}]
    after = [{"batches": 5, "rows": 9, "sizes": {"1": 3, "4": 2}}]
    assert hop_figures(before, after) == [
        {"batches": 3, "rows": 7, "mean_rows": 2.33, "largest": 4, "sizes": {"1": 1, "4": 2}}
    ]
