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
