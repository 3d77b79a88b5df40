"""Progress on long steps: one line per phase in a log, a bar on a terminal."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from runtime.model.progress import Progress
from runtime.model.recipes import RECIPES
from runtime.model.tiny import make_tiny_model


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_phase_and_one_at_the_end() -> None:
    lines: list[str] = []
    with Progress("build", emit=lines.append) as progress:
        progress.phase("hashing", 3)
        for _ in range(3):
            progress.advance()
        progress.phase("writing")
    assert lines[:2] == ["build: hashing (3)", "build: writing"]
    assert lines[2].startswith("build: done in ") and lines[2].endswith(" s")
    assert len(lines) == 3


def test_a_terminal_gets_a_bar_per_phase_and_a_failure_no_done_line() -> None:
    screen = Terminal()
    with Progress("build", stream=screen) as progress:
        progress.phase("hashing", 4)
        progress.advance(4)
    drawn = screen.getvalue()
    assert "build: hashing" in drawn and "/4 [" in drawn and "\r" in drawn  # a bar, redrawn
    assert "done in" in drawn
    quiet = Terminal()
    try:
        with Progress("build", stream=quiet) as progress:
            progress.phase("hashing", 4)
            raise RuntimeError("disk full")
    except RuntimeError:
        pass
    assert "done in" not in quiet.getvalue()


def test_manifest_build_says_what_it_is_doing(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", layers=2, with_manifest=False)
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "manifest", "build", str(model)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardmesh")]
    assert lines[0].startswith("shardmesh manifest build: hashing tensors (")
    assert lines[1] == "shardmesh manifest build: golden activations, layer by layer (2)"
    # Then each recipe's calibration (the error an honest shard of it shows).
    calibrating = [line.removeprefix("shardmesh manifest build: ") for line in lines[2:-1]]
    assert [line.split(":")[0] for line in calibrating] == [
        f"calibrating {recipe}" for recipe in RECIPES
    ]
    assert lines[-1].startswith("shardmesh manifest build: done in ")


def test_the_doctor_says_which_check_it_is_on(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", layers=2)
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "doctor", "--model", str(model), "--layers", "0:2",
         "--recipe", "fp32", "--backend", "torch", "--no-measure"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardmesh doctor")]
    phases = [line.removeprefix("shardmesh doctor: ") for line in lines]
    assert phases[:4] == ["backend", "manifest", "span", "recipe"]
    assert phases[4] == "memory"
    assert phases[5].startswith("checking tensor digests (")
    assert phases[6:8] == ["loading the shard", "probe forward pass"]
    assert phases[8].startswith("done in ") and len(phases) == 9
