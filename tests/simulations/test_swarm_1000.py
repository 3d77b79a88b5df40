"""Issue acceptance at full size: 1,000 simulated nodes running the real core.

These are the expensive runs (minutes of CPU in all), so they live in the
slow tier; `make test` still runs them. They run in fresh processes on the
compiled core (`simulations.compiled`: the same source built with mypyc,
refused when stale, its trace digest equal to the source's by
tests/simulations/test_compiled.py), which takes 40-45% less CPU; where no C
compiler exists they run on the source. Every run this module's selected
tests need starts at once, in one pool of a process per core at low
priority: the runs soak up the cores the rest of the suite leaves idle (a
swarm test mostly waits on its timers) and give way to it when it is busy.
Each run is deterministic, so where and when it runs changes nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from simulations import compiled
from tests.simulations.thousand_node_runs import lossy_run, partition_run

# The suite's 300 s guard is for hangs; these runs are known long (minutes
# on 2 cores beside a busy process), so they get three times the guard.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FALSE_POSITIVE_SEEDS = range(2000, 2020)
PARTITION_SEED = 31
NICENESS = 10
"""How far below the rest of the suite the runs' processes are scheduled:
enough that a swarm test's node processes (whose timeouts assume one busy
core beside them, not three) take the CPU whenever they want it."""


@pytest.fixture(scope="module")
def core() -> Path | None:
    """The compiled core, built once for every test that asks (a minute at
    low priority), or None without a C compiler."""
    return compiled.ensure_built(niceness=NICENESS) if shutil.which("cc") else None


@dataclass
class Runs:
    """The runs of the selected tests, submitted together (longest first)."""

    partition: Future[dict[str, object]] | None = None
    lossy: list[Future[tuple[int, bool, int, list[tuple[float, int, int]]]]] = field(
        default_factory=list
    )


@pytest.fixture(scope="module")
def runs(
    core: Path | None, request: pytest.FixtureRequest, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[Runs]:
    """Fresh processes (this one has imported the simulator from source)
    that load the compiled core, one per core, running every run that a
    selected test of this module asks for."""
    if core is not None:
        monkeypatch_module.setenv(compiled.ENV_VAR, str(core))
    selected = {
        item.name
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }

    def _selected(test: object) -> bool:
        return getattr(test, "__name__", "") in selected

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=os.cpu_count() or 1,
        mp_context=context,
        initializer=os.nice,
        initargs=(NICENESS,),
    ) as executor:
        submitted = Runs()
        if _selected(test_a_50_50_partition_is_declared_dead_across_and_heals_to_full_membership):
            submitted.partition = executor.submit(partition_run, PARTITION_SEED)
        if _selected(test_twenty_seeds_at_10_percent_loss_declare_nobody_dead):
            submitted.lossy = [executor.submit(lossy_run, seed) for seed in FALSE_POSITIVE_SEEDS]
        yield submitted
        for future in [submitted.partition, *submitted.lossy]:
            if future is not None:
                future.cancel()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_twenty_seeds_at_10_percent_loss_declare_nobody_dead(runs: Runs, core: Path | None) -> None:
    results = [future.result() for future in runs.lossy]
    assert len(results) == 20
    for seed, on_compiled, suspicions, false_positives in results:
        assert on_compiled == (core is not None), f"seed {seed} ran on the other core"
        assert suspicions > 0, f"seed {seed}: 10% loss should cause suspicions"
        assert false_positives == [], f"seed {seed}: (time, observer, subject) wrongly dead"


def test_a_50_50_partition_is_declared_dead_across_and_heals_to_full_membership(
    runs: Runs, core: Path | None
) -> None:
    assert runs.partition is not None
    result = runs.partition.result()
    assert result["compiled"] == (core is not None)
    assert result["undecided_at_end"] == [], (
        "pairs (observer, subject) across the cut not declared dead"
    )
    assert result["view_agreement"] == 1.0
    # Every verdict came from the partition: none is a false positive.
    assert result["false_positives"] == []
