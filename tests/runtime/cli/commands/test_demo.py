"""`shardmesh demo`'s flags (the demo itself: tests/runtime/cli/test_demo.py)."""

from __future__ import annotations

import pytest

from tests.runtime.cli.test_main import assert_usage_error


def test_bad_arguments_exit_2_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(["demo", "--nodes", "1"], "at least 2 nodes", capsys)
