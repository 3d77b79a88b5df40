"""`shardmesh demo` (what `make demo` runs) end to end, on a machine that
another CPU-heavy job keeps busy (the quiet case is the easier one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

from tests.runtime.cli.test_main import shardmesh_command

LOADED_DEMO_TIMEOUT_S = 240.0
"""Under the load below a demo takes about twice as long as on a quiet
machine (its nodes get half the cores); the bound leaves room beyond that."""

LOADED_RUNS_ENV = "SHARDMESH_DEMO_RUNS"
LOADED_RUNS = 1
"""Demos in a row under load in the suite (one is about 80 s on 2 cores).
The issue's soak is ten: `SHARDMESH_DEMO_RUNS=10 pytest
tests/runtime/cli/test_demo.py` runs it."""

BURNER = """
import time
import numpy as np
a = np.random.default_rng(0).standard_normal((256, 256))
deadline = time.monotonic() + float(__import__("sys").argv[1])
while time.monotonic() < deadline:
    a = np.tanh(a @ a)
"""
"""One busy process: matmuls (cores and memory bandwidth, as a build or a
training job would take them), stopping by itself at its deadline should
the test die before it kills it."""


async def run_demo(timeout_s: float) -> str:
    """The demo's output, after asserting that it exits 0, tells its whole
    story and stops its nodes without a traceback."""
    with trio.fail_after(timeout_s):
        result = await trio.run_process(
            [*shardmesh_command(), "demo"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    everything = out + result.stderr.decode()
    assert result.returncode == 0, everything
    assert "Traceback" not in everything, everything
    assert "exit codes: node0=0, node1=0, node2=0" in out
    assert out.rstrip().endswith("demo ok")
    return out


@pytest.mark.slow
async def test_demo_passes_in_a_row_beside_a_cpu_heavy_job() -> None:
    """The issue's failure: on a busy machine the demo's stop step timed out
    with a traceback. A load generator holds every core while the demo runs
    (again and again under SHARDMESH_DEMO_RUNS), and each run tells the
    whole story."""
    runs = int(os.environ.get(LOADED_RUNS_ENV, LOADED_RUNS))
    burn_s = str(runs * LOADED_DEMO_TIMEOUT_S)
    one_thread = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    burners = [
        subprocess.Popen([sys.executable, "-c", BURNER, burn_s], env=one_thread)
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        for _ in range(runs):
            check_story(await run_demo(LOADED_DEMO_TIMEOUT_S))
        assert all(burner.poll() is None for burner in burners), "the load stopped early"
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def check_story(out: str) -> None:
    assert "full membership at every node" in out
    assert "tiny-qwen3 fully covered" in out
    assert "tokens streamed through node0, node1, node2]" in out
    assert "where the time went: first token " in out
    assert "coverage: tiny-qwen3 (8 layers): covered [0, 8); gaps none" in out
    assert "HTTP 503 model_loading" in out and "HTTP 200 through" in out
    assert "without it: HTTP 401 unauthorized" in out and "committed at index" in out
    assert "tiny-llama [0, 4) fp32 tier managed managed=True" in out
    assert "declared node4 dead" in out and "within" in out
