"""Imports point one way (ARCHITECTURE.md): mesh <- consensus <- runtime,
simulations beside runtime, inside runtime model <- inference <- node <-
api/cli, the lab apart (only cli and benchmarks import it), and benchmarks
on top of all four, imported by none. Every module is
parsed with `ast` (nothing is imported), so every import counts: module level,
inside functions, under TYPE_CHECKING, relative.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("mesh", "consensus", "runtime", "simulations", "benchmarks")
RUNTIME_FOLDERS = ("model", "inference", "node", "api", "cli", "lab")

# What each unit may import from the checked packages (its own unit included).
# "runtime" alone is runtime/__init__.py, open to every runtime folder.
_UNDER_RUNTIME = frozenset({"mesh", "consensus", "runtime"})
ALLOWED: dict[str, frozenset[str]] = {
    "mesh": frozenset({"mesh"}),
    "consensus": frozenset({"mesh", "consensus"}),
    "simulations": frozenset({"mesh", "consensus", "simulations"}),
    "runtime": _UNDER_RUNTIME,
    "runtime.model": _UNDER_RUNTIME | {"runtime.model"},
    "runtime.inference": _UNDER_RUNTIME | {"runtime.model", "runtime.inference"},
    "runtime.node": _UNDER_RUNTIME | {"runtime.model", "runtime.inference", "runtime.node"},
    "runtime.api": _UNDER_RUNTIME
    | {"runtime.model", "runtime.inference", "runtime.node", "runtime.api"},
    # and `shardmesh simulate` runs the simulator: no other runtime folder imports it;
    # `shardmesh lab` builds the WAN testbed
    "runtime.cli": _UNDER_RUNTIME
    | {
        "runtime.model",
        "runtime.inference",
        "runtime.node",
        "runtime.cli",
        "runtime.lab",
        "simulations",
    },
    # the WAN testbed stands apart: namespaces and packets, none of the swarm's code
    "runtime.lab": frozenset({"runtime.lab"}),
    # benchmarks measure the real parts, any of them; nothing imports a benchmark
    "benchmarks": _UNDER_RUNTIME
    | {
        "runtime.model",
        "runtime.inference",
        "runtime.node",
        "runtime.api",
        "runtime.cli",
        "runtime.lab",
        "simulations",
        "benchmarks",
    },
}
RULES = {
    "mesh": "mesh imports no other package (mesh <- consensus <- runtime)",
    "consensus": "consensus imports only mesh (mesh <- consensus <- runtime)",
    "simulations": "simulations imports only mesh and consensus, never runtime",
    "runtime": "runtime/__init__.py imports no runtime folder",
    "runtime.model": "runtime/model imports no other runtime folder",
    "runtime.inference": "runtime/inference imports only runtime/model",
    "runtime.node": "runtime/node imports only runtime/model and runtime/inference "
    "(only node/daemon.py may import runtime.api.app)",
    "runtime.api": "runtime/api imports only runtime/model, inference and node (not cli)",
    "runtime.cli": "runtime/cli imports only runtime/model, inference, node, lab and "
    "simulations (not api)",
    "runtime.lab": "runtime/lab imports nothing of ours but itself",
    "benchmarks": "benchmarks import only mesh, consensus, runtime and simulations",
}
# Checked before each unit's own rule: benchmarks sit on top of everything.
ON_TOP = "no package imports benchmarks (benchmarks sit on top of the other four)"
# The composition root serves the HTTP app: the one import against the grain.
EXCEPTIONS = frozenset({("runtime/node/daemon.py", "runtime.api.app")})
# ARCHITECTURE.md: the protocol cores and the simulator never load a model library.
HEAVY = frozenset({"torch", "mlx", "mlx_lm", "transformers", "safetensors", "tokenizers"})
NO_HEAVY = frozenset({"mesh", "consensus", "simulations"})


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    target: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.target}: {self.rule}"


def unit_of(module: str) -> str | None:
    """The layer a dotted module name belongs to; None outside the checked packages."""
    parts = module.split(".")
    if parts[0] not in CHECKED:
        return None
    if parts[0] == "runtime" and len(parts) > 1 and parts[1] in RUNTIME_FOLDERS:
        return f"runtime.{parts[1]}"
    return parts[0]


def imported_modules(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import; `from a import b` gives `a.b`, since
    b may be a module (`from runtime import api`)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def check_tree(root: Path) -> list[Violation]:
    violations = []
    for top in CHECKED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            parts = list(rel.with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            module = ".".join(parts)
            unit = unit_of(module)
            assert unit is not None
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))
            for line, target in imported_modules(tree, module, is_package):
                first = target.split(".")[0]
                if unit in NO_HEAVY and first in HEAVY:
                    rule = f"{unit} never imports a model library (torch, mlx, ...)"
                    violations.append(Violation(rel.as_posix(), line, target, rule))
                    continue
                target_unit = unit_of(target)
                if target_unit is None or target_unit in ALLOWED[unit]:
                    continue
                if target_unit == "benchmarks":
                    violations.append(Violation(rel.as_posix(), line, target, ON_TOP))
                    continue
                if any(
                    rel.as_posix() == src
                    and (target == allowed or target.startswith(allowed + "."))
                    for src, allowed in EXCEPTIONS
                ):
                    continue
                violations.append(Violation(rel.as_posix(), line, target, RULES[unit]))
    return violations


def test_imports_point_one_way() -> None:
    violations = check_tree(ROOT)
    assert not violations, "imports against the layering:\n" + "\n".join(map(str, violations))


def test_runtime_is_its_folders() -> None:
    """No module under runtime/ sits outside its folders."""
    stray = sorted(
        p.name
        for p in (ROOT / "runtime").iterdir()
        if p.name not in ("__init__.py", "__pycache__", *RUNTIME_FOLDERS)
        and (p.suffix == ".py" or p.is_dir())
    )
    assert not stray, f"runtime/ holds {stray} outside its folders {RUNTIME_FOLDERS}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_checker_reports_each_direction(tmp_path: Path) -> None:
    """The checker itself, on a synthetic tree: each kind of bad import is
    reported with its file, line and rule; good ones are not."""
    _write(
        tmp_path,
        {
            "mesh/__init__.py": "",
            "mesh/wire.py": "import os\nfrom mesh import records\n",
            "mesh/bad.py": "import json\n\ndef f():\n    from runtime.node import daemon\n",
            "consensus/raft.py": "from mesh.wire import x\nimport simulations.loop\n",
            "simulations/loop.py": "import runtime.model.doctor\nimport torch\n",
            "runtime/__init__.py": "",
            "runtime/model/doctor.py": "from runtime.node.admission import Admission\n",
            "runtime/model/backends/base.py": "from ..weights import read\nfrom . import base\n",
            "runtime/node/daemon.py": "from runtime.api.app import create_app\n",
            "runtime/node/status.py": "from runtime.api.app import create_app\n",
            "runtime/api/app.py": "from runtime.node.daemon import x\nfrom runtime import cli\n",
            "runtime/cli/main.py": "from runtime.node.hostport import p\nfrom ..api import app\n",
            "runtime/cli/commands/lab.py": "from runtime.lab.netns import Lab\n",
            "runtime/lab/netns.py": "from runtime.lab import topology\nfrom mesh import wire\n",
        },
    )
    found = {(v.path, v.line, v.target) for v in check_tree(tmp_path)}
    assert found == {
        ("mesh/bad.py", 4, "runtime.node.daemon"),
        ("consensus/raft.py", 2, "simulations.loop"),
        ("simulations/loop.py", 1, "runtime.model.doctor"),
        ("simulations/loop.py", 2, "torch"),
        ("runtime/model/doctor.py", 1, "runtime.node.admission.Admission"),
        ("runtime/node/status.py", 1, "runtime.api.app.create_app"),
        ("runtime/api/app.py", 2, "runtime.cli"),
        ("runtime/cli/main.py", 2, "runtime.api.app"),
        ("runtime/lab/netns.py", 2, "mesh.wire"),
    }, found
    message = str(next(v for v in check_tree(tmp_path) if v.path == "mesh/bad.py"))
    assert message.startswith("mesh/bad.py:4: imports runtime.node.daemon: mesh imports no")


def test_checker_keeps_benchmarks_on_top(tmp_path: Path) -> None:
    """Benchmarks may import every other package; no other package may
    import a benchmark, and the report says so."""
    _write(
        tmp_path,
        {
            "mesh/__init__.py": "",
            "mesh/wire.py": "from benchmarks.gossip import run\n",
            "consensus/raft.py": "import benchmarks\n",
            "runtime/__init__.py": "",
            "runtime/node/daemon.py": "from benchmarks import pipeline\n",
            "simulations/loop.py": "from benchmarks.simulator import main\n",
            "benchmarks/__init__.py": "",
            "benchmarks/gossip.py": "from mesh.wire import x\nfrom simulations import loop\n",
            "benchmarks/pipeline.py": (
                "import torch\nfrom runtime.cli.localswarm import LocalSwarm\n"
                "from runtime.api.app import create_app\nfrom consensus import raft\n"
                "from . import gossip\n"
            ),
        },
    )
    violations = check_tree(tmp_path)
    assert {(v.path, v.line, v.target) for v in violations} == {
        ("mesh/wire.py", 1, "benchmarks.gossip.run"),
        ("consensus/raft.py", 1, "benchmarks"),
        ("runtime/node/daemon.py", 1, "benchmarks.pipeline"),
        ("simulations/loop.py", 1, "benchmarks.simulator.main"),
    }
    assert {v.rule for v in violations} == {ON_TOP}
