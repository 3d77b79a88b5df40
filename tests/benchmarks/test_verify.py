"""`python -m benchmarks.verify --quick --json` runs every path of the
verified-compute benchmark and reports what it must.

The quick mode is a few dozen real requests through real in-process nodes
(ZeroMQ planes, torch shards of the tiny model): a liar that lies on every
forward must be caught by every checked request, and the leader must find
it guilty. It runs as a subprocess, as from the command line, so the
torch thread setting it makes for its run stays out of this process.
Beyond that: the plumbing (every figure, target and anchor), the detection
arithmetic, and the honest runs: no divergence in fp32, and no false
quarantine at all (the full run's 2,000 requests are the stronger check).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Final

import pytest

from benchmarks.verify import TARGETS, p99_requests
from tests import REPO

pytestmark = pytest.mark.slow  # the quick benchmark run takes ~15-20 s: left to `make test`

REPO: Final = REPO
QUICK_TIMEOUT_S: Final = 120
"""About 15 s on an idle 2-core machine, 30 s on a busy one; room beyond."""
FIGURES: Final = (
    "detect_requests_p99_always",
    "detect_requests_p99_one_percent",
    "false_quarantines",
    "verify_overhead_fraction",
    "sketch_cost_fraction",
)


@pytest.fixture(scope="module")
def quick() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.verify", "--quick", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_quick_mode_reports_every_figure_against_its_target(quick: dict[str, Any]) -> None:
    for name in FIGURES:
        assert name in quick, name
        assert name in quick["targets_met"], name
    assert set(TARGETS) == set(FIGURES)
    assert isinstance(quick["false_quarantines"], int)
    assert 0 <= quick["verify_overhead_fraction"] < 1
    assert 0 < quick["sketch_cost_fraction"] < 1
    assert {"petals", "boinc_redundancy"} <= set(quick["anchors"])
    assert quick["anchors"]["boinc_redundancy"]["verify_overhead_fraction"] == 1.0
    assert quick["anchors"]["petals"]["detect_requests_p99_always"] is None


def test_an_always_lying_hop_is_caught_by_every_check_and_convicted(
    quick: dict[str, Any],
) -> None:
    always = quick["detection"]["always"]
    assert quick["p_detect_always"] == 1.0
    assert always["caught"] == always["checked_requests"] > 0
    assert always["wrongly_accused"] == 0
    assert always["divergence_kinds"] == {"output": always["checked_requests"]}
    verdicts = always["quarantine"]
    assert verdicts["guilty"] == verdicts["adjudicated"] > 0
    assert verdicts["extra_requests"] == 0
    # p = f * 1: the closed form and the simulated process agree.
    fraction = quick["verify_fraction"]
    assert quick["detect_requests_p99_always"] == p99_requests(fraction)
    simulated = quick["detect_requests_p99_always_monte_carlo"]
    assert abs(simulated - p99_requests(fraction)) <= 2


def test_the_fp32_honest_runs_find_no_divergence(quick: dict[str, Any]) -> None:
    fp32 = quick["honest"]["by_recipe"]["fp32"]
    assert fp32["checked"] == fp32["requests"] > 0
    assert fp32["divergences"] == 0
    assert quick["honest_requests"] == sum(
        r["requests"] for r in quick["honest"]["by_recipe"].values()
    )


def test_no_honest_request_diverges(quick: dict[str, Any]) -> None:
    assert quick["false_quarantines"] == 0, quick["honest"]["all"]["examples"]


def test_p99_requests_is_the_geometric_quantile() -> None:
    assert p99_requests(0.0) is None
    assert p99_requests(1.0) == 1
    # 1 - 0.75^16 = 0.98998 < 0.99 <= 1 - 0.75^17
    assert p99_requests(0.25) == 17
    for p in (0.01, 0.07, 0.3, 0.9):
        n = p99_requests(p)
        assert n is not None
        assert 1 - (1 - p) ** n >= 0.99 > 1 - (1 - p) ** (n - 1)
