"""`shardmesh demo` (what `make demo` runs) end to end."""

from __future__ import annotations

import pytest
import trio

from tests.test_cli import shardmesh_command

DEMO_TIMEOUT_S = 120.0


@pytest.mark.slow
async def test_demo_runs_and_exits_0() -> None:
    with trio.fail_after(DEMO_TIMEOUT_S):
        result = await trio.run_process(
            [*shardmesh_command(), "demo"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "full membership at every node" in out
    assert "tiny-qwen3 fully covered" in out
    assert "tokens streamed through node0, node1, node2]" in out
    assert "where the time went: first token " in out
    assert "coverage: tiny-qwen3 (8 layers): covered [0, 8); gaps none" in out
    assert "HTTP 503 model_loading" in out and "HTTP 200 through" in out
    assert "without it: HTTP 401 unauthorized" in out and "committed at index" in out
    assert "tiny-llama [0, 4) fp32 tier managed managed=True" in out
    assert "declared node4 dead" in out and "within" in out
    assert "exit codes: node0=0, node1=0, node2=0" in out
    assert out.rstrip().endswith("demo ok")
