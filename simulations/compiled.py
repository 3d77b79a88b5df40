"""The simulator's hot modules compiled with mypyc: the same source, in less CPU.

`HOT_MODULES` (the membership core, its member table, broadcast queue and
delta sync, and the simulated cluster) compile into `build/sim-core/`
(`make sim-core`); `SHARDMESH_SIM_CORE=build/sim-core` or `use` runs them,
with the same trace digest as the source. A build records a digest of each
source it compiled and `use` refuses a stale one. `use` must run before the
modules it replaces are imported: it puts the build first on the `mesh` and
`simulations` package paths. Measured gains and the reasons:
docs/design/simulator.md and docs/simulation.md, "The compiled core".
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
"""The source tree: every path below is relative to it."""

DEFAULT_DIR: Final = ROOT / "build" / "sim-core"
"""Where `make sim-core` puts the build (ignored by git, like all of build/)."""

ENV_VAR: Final = "SHARDMESH_SIM_CORE"
"""Names a build directory to run simulations from (module doc)."""

HOT_MODULES: Final = (
    "mesh/membership.py",
    "mesh/member_table.py",
    "mesh/broadcasts.py",
    "mesh/sync.py",
    "simulations/cluster.py",
)
"""What a profile of the 1,000-node benchmark cases spends its time in.
Three busy modules stay plain Python: the event loop (`simulations/loop.py`),
whose timers subclass `list`, which mypyc cannot compile; the messages
(`mesh/messages.py`), whose frozen dataclasses cache on themselves in a way
mypyc's dataclasses do not support; and the network (`simulations/network.py`),
whose `NetworkConfig` the scenario schema reads field types and docstrings
from, which a compiled dataclass no longer has. The network is about a
tenth of a profile, so compiling it could add little."""

OPT_LEVEL: Final = "1"
"""mypyc's C optimisation level: the level every figure in the module doc
was measured at. The build takes about a minute here; at mypyc's default,
3, the C compiler was still at it after 13 minutes."""

MANIFEST: Final = "manifest.json"


class CompiledCoreError(RuntimeError):
    """A build that cannot be used: missing, stale, for another Python, or
    loaded too late."""


def _digest(relative: str) -> str:
    return hashlib.sha256((ROOT / relative).read_bytes()).hexdigest()


def _python_tag() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def _module_name(relative: str) -> str:
    return relative.removesuffix(".py").replace("/", ".")


def build(
    out: Path = DEFAULT_DIR, modules: Sequence[str] = HOT_MODULES, *, niceness: int = 0
) -> Path:
    """Compile `modules` (paths relative to the source tree) into `out`,
    `niceness` below this process's priority (a test suite builds it
    beside work that should not wait for the C compiler).

    mypyc writes its C sources (and the compiler its objects) under
    `out/c-src/`, so that two builds never share them, and setuptools puts
    the extensions under `out`; the manifest is written last, so an
    interrupted build is never taken for a finished one."""
    out = out.resolve()
    (out / MANIFEST).unlink(missing_ok=True)
    script = (
        "import sys\n"
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        "out, temp, opt, *paths = sys.argv[1:]\n"
        "setup(name='shardmesh-sim-core', ext_modules=mypycify(paths, opt_level=opt,"
        " target_dir=temp), script_args=['build_ext', '--build-lib', out,"
        " '--build-temp', temp])\n"
    )
    temp = out / "c-src"
    args = [sys.executable, "-c", script, str(out), str(temp), OPT_LEVEL, *modules]
    started = time.monotonic()
    print(
        f"compiling {len(modules)} modules with mypyc into {out} (a minute or two)...",
        file=sys.stderr,
    )
    done = subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=(lambda: os.nice(niceness)) if niceness else None,
    )
    if done.returncode != 0:
        raise CompiledCoreError(
            f"mypyc failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    manifest = {
        "python": _python_tag(),
        "opt_level": OPT_LEVEL,
        "modules": {relative: _digest(relative) for relative in modules},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"compiled in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return out


def ensure_built(out: Path = DEFAULT_DIR, *, niceness: int = 0) -> Path:
    """The build in `out`, compiled first (at `niceness`, see `build`) where
    it is missing or stale. One process at a time compiles (a lock file
    beside `out`): parallel test workers or `make sim-core` beside a test
    wait, then use the same build."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{out.name}.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            if stale(out) is not None:
                build(out, niceness=niceness)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return out


def stale(out: Path) -> str | None:
    """Why the build in `out` cannot be used now, or None if it can."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no compiled core in {out} (build one with `make sim-core`)"
    except (OSError, ValueError) as exc:
        return f"{out / MANIFEST}: unreadable ({exc}); rebuild with `make sim-core`"
    if manifest.get("python") != _python_tag():
        return f"{out} was built for {manifest.get('python')}, this Python needs {_python_tag()}"
    changed = [
        relative
        for relative, digest in manifest.get("modules", {}).items()
        if not (ROOT / relative).is_file() or _digest(relative) != digest
    ]
    if changed:
        return (
            f"{out} was compiled from older sources ({', '.join(changed)} changed since); "
            "rebuild with `make sim-core`"
        )
    return None


def compiled_modules(out: Path) -> list[str]:
    """The dotted names the build in `out` replaces."""
    manifest = json.loads((out / MANIFEST).read_text())
    return [_module_name(relative) for relative in manifest["modules"]]


def use(out: Path) -> list[str]:
    """Make the next imports of the compiled modules load the build in
    `out`; returns their names. Raises `CompiledCoreError` when the build is
    stale (see `stale`) or when one of them is already imported."""
    out = out.resolve()
    why = stale(out)
    if why is not None:
        raise CompiledCoreError(why)
    names = compiled_modules(out)
    early = [name for name in names if name in sys.modules]
    if early:
        raise CompiledCoreError(
            f"{', '.join(early)} already imported from source: "
            "choose the compiled core before importing the simulator"
        )
    packages = {name.rpartition(".")[0] for name in names}
    sys.path.insert(0, str(out))  # mypyc's shared runtime library is top-level
    for package in sorted(packages):
        module = __import__(package)
        path = str(out / package)
        if path not in module.__path__:
            module.__path__.insert(0, path)
    return names


def is_compiled() -> bool:
    """Whether the membership core this process runs is a compiled build."""
    import mesh.membership

    return not str(mesh.membership.__file__).endswith(".py")


def use_from_environment() -> list[str]:
    """`use` the build `SHARDMESH_SIM_CORE` names, if it names one (module
    doc); [] when it is unset or empty."""
    where = os.environ.get(ENV_VAR, "")
    return use(Path(where)) if where else []


def main() -> int:
    """`make sim-core`: build the compiled core into build/sim-core/ where
    it is missing or stale. (Not `python -m`, which would import this module
    twice: the package imports it first.)"""
    try:
        print(f"compiled core ready in {ensure_built()}", file=sys.stderr)
    except CompiledCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
