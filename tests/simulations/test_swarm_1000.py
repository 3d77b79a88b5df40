"""Issue acceptance at full size: 1,000 simulated nodes running the real core.

These are the expensive runs (minutes of CPU in all), so they live in the
slow tier; `make test` still runs them. They run in fresh processes on the
compiled core (`simulations.compiled`: the same source built with mypyc,
refused when stale, its trace digest equal to the source's by
tests/simulations/test_compiled.py), which takes 40-45% less CPU; where no C
compiler exists they run on the source. Seeds run in parallel processes, one
per core this test may take: each run is deterministic, so where it runs
changes nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from simulations import compiled
from tests.simulations.thousand_node_runs import lossy_run, partition_run

# The suite's 300 s guard is for hangs; these runs are known long (minutes
# on 2 cores beside a busy process), so they get three times the guard.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FALSE_POSITIVE_SEEDS = range(2000, 2020)
PARTITION_SEED = 31


@pytest.fixture(scope="module")
def core() -> Path | None:
    """The compiled core, built once for every test that asks (a minute),
    or None without a C compiler."""
    return compiled.ensure_built() if shutil.which("cc") else None


@pytest.fixture
def pool(core: Path | None, monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessPoolExecutor]:
    """Fresh processes (this one has imported the simulator from source) that
    load the compiled core, as many as this test's share of the cores."""
    if core is not None:
        monkeypatch.setenv(compiled.ENV_VAR, str(core))
    workers = max(1, min(len(FALSE_POSITIVE_SEEDS), _cores_for_this_worker()))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as executor:
        yield executor


def _cores_for_this_worker() -> int:
    """The cores this test may take: all of them, or its share when `make
    test` runs the suite on several xdist workers (the others are busy)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


def test_twenty_seeds_at_10_percent_loss_declare_nobody_dead(
    pool: ProcessPoolExecutor, core: Path | None
) -> None:
    results = list(pool.map(lossy_run, FALSE_POSITIVE_SEEDS))
    assert len(results) == 20
    for seed, on_compiled, suspicions, false_positives in results:
        assert on_compiled == (core is not None), f"seed {seed} ran on the other core"
        assert suspicions > 0, f"seed {seed}: 10% loss should cause suspicions"
        assert false_positives == [], f"seed {seed}: (time, observer, subject) wrongly dead"


def test_a_50_50_partition_is_declared_dead_across_and_heals_to_full_membership(
    pool: ProcessPoolExecutor, core: Path | None
) -> None:
    result = pool.submit(partition_run, PARTITION_SEED).result()
    assert result["compiled"] == (core is not None)
    assert result["undecided_at_end"] == [], (
        "pairs (observer, subject) across the cut not declared dead"
    )
    assert result["view_agreement"] == 1.0
    # Every verdict came from the partition: none is a false positive.
    assert result["false_positives"] == []
