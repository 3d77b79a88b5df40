"""Issue acceptance at full size: 1,000 simulated nodes running the real core.

These are the expensive runs (minutes of CPU in all), so they live in the
slow tier; `make test` still runs them. They run in fresh processes on the
compiled core (`simulations.compiled`: the same source built with mypyc,
refused when stale, its trace digest equal to the source's by
tests/simulations/test_compiled.py), which takes 40-45% less CPU; where no C
compiler exists they run on the source. Every run this module's selected
tests need starts right after collection, in a pool of a process per core at
low priority (tests/simulations/thousand_node_pool.py): the runs soak up the
cores the rest of the suite leaves idle, and these tests, handed out last
(tests/conftest.py), read their results. Each run is deterministic, so where
and when it runs changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.simulations import thousand_node_pool as pool

# The suite's 300 s guard is for hangs; these runs are known long (minutes
# on 2 cores beside a busy suite), so they get three times the guard.
TIMEOUT_S = 900
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S)]
WAIT_S = TIMEOUT_S - 30
"""How long a test waits for a result: under its guard, so a late run says
so with the runner's log instead of a bare timeout."""


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[Path]:
    """The session's runner directory (started after collection)."""
    where = pool.session_dir(request.config)
    yield where
    pool.finish(where)


@pytest.fixture(scope="module")
def core(runs: Path) -> Path | None:
    return pool.core(runs, WAIT_S)


@pool.needs("lossy")
def test_twenty_seeds_at_10_percent_loss_declare_nobody_dead(runs: Path, core: Path | None) -> None:
    results = [pool.result(runs, "lossy", seed, WAIT_S) for seed in pool.FALSE_POSITIVE_SEEDS]
    assert len(results) == 20
    for seed, on_compiled, suspicions, false_positives in results:
        assert on_compiled == (core is not None), f"seed {seed} ran on the other core"
        assert suspicions > 0, f"seed {seed}: 10% loss should cause suspicions"
        assert false_positives == [], f"seed {seed}: (time, observer, subject) wrongly dead"


@pool.needs("partition")
def test_a_50_50_partition_is_declared_dead_across_and_heals_to_full_membership(
    runs: Path, core: Path | None
) -> None:
    result = pool.result(runs, "partition", pool.PARTITION_SEED, WAIT_S)
    assert result["compiled"] == (core is not None)
    assert result["undecided_at_end"] == [], (
        "pairs (observer, subject) across the cut not declared dead"
    )
    assert result["view_agreement"] == 1.0
    # Every verdict came from the partition: none is a false positive.
    assert result["false_positives"] == []
