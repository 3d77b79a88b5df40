"""Shared fixtures: real node processes on loopback.

`swarm` gives a `runtime.cli.localswarm.LocalSwarm` rooted in the test's tmp
dir. Its exit SIGKILLs every child whatever happened, and when the test
failed, every node's log is printed (pytest shows it under the failure), so
a flaky multi-process failure can be read rather than re-run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from runtime.cli.localswarm import LocalSwarm

# The tiny-model fixtures (tests/runtime_fixtures.py), for every package's tests.
pytest_plugins = ["tests.runtime_fixtures"]


SWARMS_GROUP = "swarms"
"""The xdist group of every test that starts node processes (`make test` runs
`pytest -n auto --dist loadgroup`): they run one after another on one worker,
as their timeouts assume (a loaded machine, not several swarms at once),
while the other workers take the in-process tests."""


STARTS_NODES_WITHOUT_FIXTURE = frozenset({"test_demo.py"})
"""Modules whose tests start swarms of their own (`shardmesh demo`)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that start node processes `swarm` (`make check` leaves
    them to `make test`), and group each test for `--dist loadgroup`: swarm
    tests together, every other test with the rest of its module, so a
    module's fixtures are built once, on one worker."""
    for item in items:
        starts_nodes = (
            "swarm" in getattr(item, "fixturenames", ()) or "processes" in item.path.parts
        )
        if starts_nodes:
            item.add_marker(pytest.mark.swarm)
        item.add_marker(pytest.mark.xdist_group(SWARMS_GROUP if starts_nodes else str(item.path)))


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
