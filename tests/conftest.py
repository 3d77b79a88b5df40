"""Shared fixtures: real node processes on loopback.

`swarm` gives a `runtime.cli.localswarm.LocalSwarm` rooted in the test's tmp
dir. Its exit SIGKILLs every child whatever happened, and when the test
failed, every node's log is printed (pytest shows it under the failure), so
a flaky multi-process failure can be read rather than re-run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

if "PYTEST_XDIST_WORKER" in os.environ:  # before anything loads torch's OpenMP
    # One worker per core (`make test`, `-n auto`): a second intra-op thread
    # only spins on a core another worker holds. Measured on a 2-core box, a
    # checkpoint's conversion took 21 CPU-s on one thread, 26 on two, 34 on
    # two beside a busy core. Node processes get the same (localswarm's
    # SHARED_MACHINE_ENV); a test that wants more threads sets them itself.
    for _pool in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_pool, "1")

import pytest

from runtime.cli.localswarm import LocalSwarm

# The tiny-model fixtures (tests/runtime_fixtures.py), for every package's tests.
pytest_plugins = ["tests.runtime_fixtures"]


SWARMS_GROUP = "swarms"
"""The xdist group of every module that starts node processes (`make test`
runs `pytest -n auto --dist loadgroup`): they run one after another on one
worker, as their timeouts assume (a loaded machine, not several swarms at
once), while the other workers take the in-process tests."""

SWARM_MODULES = frozenset(
    {
        "tests/benchmarks/test_concurrency.py",
        "tests/benchmarks/test_wan.py",
        "tests/runtime/api/test_app.py",
        "tests/runtime/api/test_auth.py",
        "tests/runtime/api/test_metrics.py",
        "tests/runtime/api/test_quota.py",
        "tests/runtime/api/test_web_page.py",
        "tests/runtime/cli/commands/test_node.py",
        "tests/runtime/cli/commands/test_policy.py",
        "tests/runtime/cli/commands/test_status.py",
        "tests/runtime/cli/test_demo.py",
        "tests/runtime/cli/test_forkserver.py",
    }
)
"""Modules outside tests/processes/ with tests that start swarms. The
scheduler sees only test ids, so they are named here; collection stops on a
test that takes the `swarm` fixture from a module not named."""

LAB_MODULES = frozenset(
    {
        "tests/runtime/lab/test_netns.py",
        "tests/runtime/lab/test_check.py",
        "tests/runtime/cli/commands/test_lab.py",
        "tests/benchmarks/test_wan.py",
    }
)
"""Modules that build network namespaces (the WAN lab) without the `make_lab`
fixture: marked `lab` with the fixture's users, so `make check` leaves
them to `make test` (they are real-network tests, not unit tests)."""

LONGEST_FIRST = (
    SWARMS_GROUP,
    "tests/simulations/test_compiled.py",
    "tests/consensus/test_raft_random.py",
    "tests/simulations/test_placement_cluster.py",
    "tests/runtime/model/test_pretrained.py",
)
"""Groups handed out first, minutes each (measured with `--durations`), so
that no worker starts one of them while the others are finishing. A prefix
of the group's name; the Makefile turns xdist's own reordering off."""

HANDED_OUT_LAST = ("tests/simulations/test_swarm_1000.py",)
"""Groups whose work started right after collection, in the background
(tests/simulations/thousand_node_pool.py): their tests only read results,
so a worker takes them when nothing else is left."""


def xdist_group(nodeid: str) -> str:
    """The group a test id runs in: the swarms, or its module (so a module's
    fixtures are built once, on one worker)."""
    module = nodeid.split("::")[0]
    if module.startswith("tests/processes/") or module in SWARM_MODULES:
        return SWARMS_GROUP
    return module


def _rank(nodeid: str) -> int:
    group = xdist_group(nodeid)
    if group.startswith(HANDED_OUT_LAST):
        return len(LONGEST_FIRST) + 1
    return next(
        (rank for rank, prefix in enumerate(LONGEST_FIRST) if group.startswith(prefix)),
        len(LONGEST_FIRST),
    )


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` runs without the hook's plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` by `xdist_group` (xdist's own groups ride on test
    ids that pytest 9.2 no longer lets a plugin change)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that start node processes `swarm` and those that build
    namespaces `lab` (`make check` leaves both to `make test`); under xdist,
    the longest groups first."""
    for item in items:
        in_swarms = xdist_group(item.nodeid) == SWARMS_GROUP
        if "swarm" in getattr(item, "fixturenames", ()) and not in_swarms:
            raise pytest.UsageError(
                f"{item.nodeid} starts a swarm: name its module in conftest.SWARM_MODULES"
            )
        if in_swarms:
            item.add_marker(pytest.mark.swarm)
        module = item.nodeid.split("::", 1)[0]
        if module in LAB_MODULES or "make_lab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.lab)
    if getattr(config.option, "loadgroup", False) or config.getoption("dist", None) == "loadgroup":
        items.sort(key=lambda item: _rank(item.nodeid))  # stable: in-group order kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the 1,000-node runs the selected tests need (HANDED_OUT_LAST).
    Their module imports the runner's module when it is collected, so a
    session that collected none has not loaded it, and starts nothing."""
    runner = sys.modules.get("tests.simulations.thousand_node_pool")
    if runner is not None:
        runner.start_for(session)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(getattr(request.node, f"report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


@pytest.fixture
async def swarm(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[LocalSwarm]:
    async with LocalSwarm(
        tmp_path / "swarm", profile="local", node_args=["--fault-injection"]
    ) as local:
        try:
            yield local
        finally:
            if _failed(request):
                for node in local.nodes:
                    print(f"\n===== log of {node.name} ({node.log_path}) =====")
                    print(node.log_tail(200))
