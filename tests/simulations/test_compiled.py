"""The compiled simulation core (`simulations.compiled`): a build runs the
same simulation as the source, and a build that does not match the source
is refused rather than run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from simulations import compiled
from tests import REPO

ROOT = REPO

SCENARIO: dict[str, Any] = {
    "name": "compiled-vs-source",
    "duration": 60.0,
    "nodes": {"count": 120},
    "network": {"loss": 0.02},
    "faults": [
        {"kind": "partition", "at": 10.0, "heal": 30.0, "groups": [[{"range": [0, 40]}]]},
        {"kind": "crash", "node": 70, "at": 35.0},
        {"kind": "pause", "node": 90, "at": 40.0, "duration": 6.0},
        {"kind": "leave", "node": 100, "at": 45.0},
    ],
}
"""Small, but through every path the compiled modules take: suspicion and
death across a partition, copies out of the shared starting view, the
heal's delta syncs, a crash, a pause and a leave."""

RUN = """
import json, sys
from simulations.scenario import run_scenario
import mesh.membership
result = run_scenario(json.loads(sys.argv[1]), seed=7)
print(json.dumps({
    "core": result["provenance"]["core"],
    "membership_file": mesh.membership.__file__,
    "trace_digest": result["trace_digest"],
    "loop_events": result["loop_events"],
    "view_agreement": result["view_agreement"],
}))
"""


def run(core: Path | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != compiled.ENV_VAR}
    if core is not None:
        env[compiled.ENV_VAR] = str(core)
    return subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(SCENARIO)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def manifest(out: Path, **changes: Any) -> Path:
    """A build directory holding only a manifest (no extensions): what
    `stale` and `use` check before anything is loaded."""
    out.mkdir(parents=True, exist_ok=True)
    written = {
        "python": sysconfig.get_config_var("EXT_SUFFIX"),
        "opt_level": compiled.OPT_LEVEL,
        "modules": {path: compiled._digest(path) for path in compiled.HOT_MODULES},
    } | changes
    (out / compiled.MANIFEST).write_text(json.dumps(written))
    return out


def test_a_missing_build_is_named_with_how_to_make_one(tmp_path: Path) -> None:
    why = compiled.stale(tmp_path / "nothing")
    assert why is not None and "no compiled core" in why and "make sim-core" in why


def test_a_build_from_older_sources_is_refused_naming_what_changed(tmp_path: Path) -> None:
    modules = {path: compiled._digest(path) for path in compiled.HOT_MODULES}
    modules["mesh/broadcasts.py"] = "0" * 64
    out = manifest(tmp_path / "core", modules=modules)
    why = compiled.stale(out)
    assert why is not None and "mesh/broadcasts.py changed" in why
    assert "mesh/membership.py" not in why  # only the one that changed
    with pytest.raises(compiled.CompiledCoreError, match="older sources"):
        compiled.use(out)


def test_a_build_for_another_python_is_refused(tmp_path: Path) -> None:
    out = manifest(tmp_path / "core", python=".cpython-39-x86_64-linux-gnu.so")
    why = compiled.stale(out)
    assert why is not None and "cpython-39" in why


def test_a_build_chosen_after_the_modules_were_imported_is_refused(tmp_path: Path) -> None:
    import mesh.membership  # noqa: F401  # imported from source, as by any test

    out = manifest(tmp_path / "core")
    assert compiled.stale(out) is None
    with pytest.raises(compiled.CompiledCoreError, match="already imported from source"):
        compiled.use(out)


def test_the_environment_variable_with_a_stale_build_stops_the_run(tmp_path: Path) -> None:
    """A researcher who asked for the compiled core never gets the source
    silently instead (nor old code under new names)."""
    out = manifest(tmp_path / "core", modules={"mesh/membership.py": "0" * 64})
    done = run(out)
    assert done.returncode != 0
    assert "CompiledCoreError" in done.stderr and "mesh/membership.py changed" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="mypyc needs a C compiler (cc)")
def test_the_compiled_core_runs_the_same_simulation_as_the_source() -> None:
    """Build every hot module (about a minute; once per checkout and change
    of source, shared with tests/simulations/test_swarm_1000.py), then run
    one scenario on each core in its own process: the compiled modules are
    really the ones loaded, and the trace digest (every traced event and
    the scenario), the loop's event count and the view agreement are
    identical."""
    out = compiled.ensure_built()
    assert compiled.stale(out) is None
    source, built = run(None), run(out)
    assert source.returncode == 0, source.stderr
    assert built.returncode == 0, built.stderr
    plain, fast = json.loads(source.stdout), json.loads(built.stdout)
    assert plain["core"] == "python" and plain["membership_file"].endswith(".py")
    assert fast["core"] == "mypyc"
    assert fast["membership_file"].startswith(str(out)) and fast["membership_file"].endswith(".so")
    for key in ("trace_digest", "loop_events", "view_agreement"):
        assert fast[key] == plain[key], key


def test_a_fresh_build_is_used_as_it_is(tmp_path: Path) -> None:
    """What lets the 1,000-node tests and the test above share one build:
    `ensure_built` compiles only what is missing or stale."""
    out = manifest(tmp_path / "core")
    before = (out / compiled.MANIFEST).read_text()
    assert compiled.ensure_built(out) == out.resolve()
    assert (out / compiled.MANIFEST).read_text() == before
    assert sorted(path.name for path in out.iterdir()) == [compiled.MANIFEST]  # nothing built
