"""The documents stay true to the tree: ARCHITECTURE.md is the one module map.

Files are read as text (nothing of ours is imported), and each check says
what it found wrong, file by file:

- every module of the five packages is named in ARCHITECTURE.md by its
  repo-relative path (a package's `__init__.py` and `__main__.py` may be);
- every repository path ARCHITECTURE.md (and README, CONTRIBUTING and the
  docs they lead to) names exists, and every dotted name it gives
  (`consensus.ledger.PlacementLedger`) is defined where it says;
- every `.md` file that code, docs, the Makefile or pyproject.toml cite
  exists in the repository, and none cites a document outside it;
- README.md stays short and shows `make demo` and `make test` first;
- every `shardmesh` command line and `make` target the documents show is
  real (each command's `--help` is asked in a subprocess).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import REPO

PACKAGES = ("mesh", "consensus", "runtime", "simulations", "benchmarks")
MAP = "ARCHITECTURE.md"
# Modules the map need not name: what they do is to be a package.
UNLISTED = frozenset({"__init__.py", "__main__.py"})
# Where a path ARCHITECTURE.md names may start: the repository's own folders and files.
TOP_LEVEL = (*PACKAGES, "tests", "docs", ".ci")
# What the citation checks read: code, docs, scenarios, the Makefile, CI.
SCANNED_SUFFIXES = frozenset({".py", ".md", ".toml"})
SCANNED_NAMES = frozenset({"Makefile", "run"})
SKIPPED_DIRS = frozenset({"build", "out", "test-artifacts", "node_modules", "__pycache__"})
# This module's own synthetic cases cite missing and outside files on purpose.
SELF = Path(__file__).resolve()
# Documents that live outside this repository, by the names once cited
# (spelled apart so that this file cites neither).
OUTSIDE_NAMES = ("DESIGN", "ANCHORS")
OUTSIDE = re.compile(
    r"\b(?:" + "|".join(OUTSIDE_NAMES) + r")(?:\.md\b|'s\b)|(?<![\w.])\.\./shared\b"
)
# A cited Markdown file: `docs/x.md`, `ARCHITECTURE.md`, `../adr/0026-y.md`.
MD_REF = re.compile(r"(?<![\w./-])((?:\.\.?/)*[\w-][\w./-]*?\.md)(?![\w-])")
# In ARCHITECTURE.md: a `backticked` token, or a Markdown link's target.
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
PATH_TOKEN = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")

README = "README.md"
# The documents a newcomer reads first: every path and dotted name in them is real.
NAMED_DOCS = (
    MAP,
    README,
    "CONTRIBUTING.md",
    "docs/features.md",
    "docs/operations.md",
    "docs/threat-model.md",
)
README_MAX_LINES = 300
FIRST_COMMANDS = ("make demo", "make test")
# The documents whose commands are checked against the real CLI and Makefile.
COMMAND_DOCS = ("README.md", "CONTRIBUTING.md", "docs")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHARDMESH = re.compile(r"(?:^|[\s/])shardmesh(?![\w./-])((?:[ \t]+[^\s|;&#`]+)*)")
MAKE = re.compile(r"(?:^|[\s(])make[ \t]+([a-z][\w-]*)")
FLAG = re.compile(r"--[a-z][\w-]*")
# A command's subcommands, as argparse lists them in its help: `  {list,add}` alone.
SUBCOMMANDS = re.compile(r"^  \{([\w,-]+)\}", re.MULTILINE)
WORD = re.compile(r"[a-z][\w-]*")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _report(findings: list[Finding], title: str) -> str:
    return f"{title}:\n" + "\n".join(f"  {f}" for f in findings)


def _once(findings: list[Finding]) -> list[Finding]:
    """Each finding once, in order (a link's text and target often name the same file)."""
    return list(dict.fromkeys(findings))


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def scanned_files(root: Path) -> Iterator[Path]:
    """The repository's own text files (no virtualenv, caches or build output)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIPPED_DIRS
            and not d.endswith(".egg-info")
            and (not d.startswith(".") or d == ".ci")
        )
        for name in sorted(files):
            path = Path(folder) / name
            wanted = path.suffix in SCANNED_SUFFIXES or name in SCANNED_NAMES
            if wanted and path.resolve() != SELF:
                yield path


# -- (a) every module is named in the map ----------------------------------------------


def package_modules(root: Path) -> list[str]:
    """Repo-relative paths of the five packages' modules the map must name."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name not in UNLISTED and "__pycache__" not in path.parts:
                found.append(path.relative_to(root).as_posix())
    return found


def map_tokens(text: str) -> list[tuple[int, str]]:
    """(offset, token) of every `code span` and link target in the map."""
    spans = [(m.start(1), m.group(1).strip()) for m in CODE_SPAN.finditer(text)]
    links = [(m.start(1), m.group(1)) for m in LINK.finditer(text)]
    return sorted(spans + links)


def unnamed_modules(root: Path) -> list[Finding]:
    text = (root / MAP).read_text(encoding="utf-8")
    named = {token for _, token in map_tokens(text)}
    return [
        Finding(module, 1, f"not named in {MAP} (add it, with its job, to its package's table)")
        for module in package_modules(root)
        if module not in named
    ]


# -- (b) every path and dotted name the map gives exists -------------------------------


def is_repo_path(token: str) -> bool:
    """A token that claims to be a file or folder of this repository."""
    if not PATH_TOKEN.fullmatch(token):
        return False
    if token.endswith((".py", ".md")):
        return True
    return "/" in token and token.split("/", 1)[0] in TOP_LEVEL


def _module_file(root: Path, parts: list[str]) -> Path | None:
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def module_names(path: Path) -> frozenset[str]:
    """The names a module defines, assigns or imports at its top level."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return frozenset(names)


def dotted_problem(root: Path, token: str) -> str | None:
    """Why `package.module.Name` does not resolve in the tree, or None if it does."""
    parts = token.split(".")
    for cut in range(len(parts), 1, -1):
        module = _module_file(root, parts[:cut])
        if module is None:
            continue
        if cut == len(parts) or parts[cut] in module_names(module):
            return None
        return f"{parts[cut]} is not defined in {module.relative_to(root).as_posix()}"
    return "no such module"


def broken_names(root: Path, doc: str = MAP) -> list[Finding]:
    """Paths and dotted names `doc` gives that the tree does not have (a path
    may also be relative to the document's folder, as its links are)."""
    text = (root / doc).read_text(encoding="utf-8")
    folder = (root / doc).parent
    findings = []
    for offset, token in map_tokens(text):
        line = _line_of(text, offset)
        if is_repo_path(token):
            if not ((root / token).exists() or (folder / token).exists()):
                findings.append(Finding(doc, line, f"names {token}, which does not exist"))
        elif DOTTED.fullmatch(token) and token.split(".", 1)[0] in PACKAGES:
            problem = dotted_problem(root, token)
            if problem:
                findings.append(Finding(doc, line, f"names {token}: {problem}"))
    return _once(findings)


# -- (c), (d) every cited document exists, inside the repository -----------------------


def cites_outside(root: Path, source: Path, ref: str) -> bool:
    target = (source.parent / ref).resolve()
    return ref.startswith("../") and not target.is_relative_to(root.resolve())


def cite_exists(root: Path, source: Path, ref: str, md_names: set[str]) -> bool:
    """A citation holds if the file is there, read from the repository's root
    (how code names documents) or from the citing file's folder (how a
    Markdown link does); a bare file name holds if the repository has one."""
    if (root / ref).is_file() or (source.parent / ref).is_file():
        return True
    return "/" not in ref and ref in md_names


def missing_citations(root: Path) -> list[Finding]:
    md_names = {p.name for p in scanned_files(root) if p.suffix == ".md"}
    findings = []
    for path in scanned_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(root).as_posix()
        for match in MD_REF.finditer(text):
            ref = match.group(1)
            if OUTSIDE.search(ref) or cites_outside(root, path, ref):
                continue  # outside_citations reports these
            if not cite_exists(root, path, ref, md_names):
                line = _line_of(text, match.start(1))
                findings.append(Finding(rel, line, f"cites {ref}, which is not in the repository"))
    return _once(findings)


def outside_citations(root: Path) -> list[Finding]:
    findings = []
    for path in scanned_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(root).as_posix()
        for match in OUTSIDE.finditer(text):
            line = _line_of(text, match.start())
            findings.append(Finding(rel, line, f"cites {match.group(0)!r}, outside the repository"))
        for match in MD_REF.finditer(text):
            if cites_outside(root, path, match.group(1)) and not OUTSIDE.search(match.group(1)):
                line = _line_of(text, match.start(1))
                findings.append(
                    Finding(rel, line, f"cites {match.group(1)}, outside the repository")
                )
    return _once(findings)


# -- README ----------------------------------------------------------------------------


def first_code_block(text: str) -> tuple[int, list[str]]:
    """(line number of the opening fence, the lines inside) of the first fenced block."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return start + 1, lines[start + 1 : end]


def readme_problems(text: str) -> list[str]:
    problems = []
    lines = text.splitlines()
    if len(lines) > README_MAX_LINES:
        problems.append(f"{len(lines)} lines, over {README_MAX_LINES}: move detail into docs/")
    if "```" not in text:
        return [*problems, "no command block"]
    fence, block = first_code_block(text)
    before = [line for line in lines[: fence - 1] if line.strip() and not line.startswith("# ")]
    if before:
        problems.append(f"text before the first command block: {before[0]!r}")
    commands = [line.split("#", 1)[0].strip() for line in block if line.strip()]
    if tuple(commands[: len(FIRST_COMMANDS)]) != FIRST_COMMANDS:
        problems.append(f"the first command block runs {commands}, not {list(FIRST_COMMANDS)}")
    if re.search(r"^#+ Layout\b", text, re.MULTILINE):
        problems.append(f"a Layout section: the module map lives in {MAP} alone")
    return problems


# -- commands the documents show -------------------------------------------------------


def code_of(text: str) -> list[tuple[int, str]]:
    """(line, text) of every fenced block (continuation lines joined) and
    every `code span` outside them: where the documents show commands."""
    found = []
    for block in FENCE.finditer(text):
        found.append((_line_of(text, block.start(1)), re.sub(r"\\\n\s*", " ", block.group(1))))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found.extend((_line_of(prose, m.start(1)), m.group(1)) for m in CODE_SPAN.finditer(prose))
    return found


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line, words after `shardmesh`) of every command line the text shows."""
    return [
        (line, match.group(1).strip())
        for line, code in code_of(text)
        for match in SHARDMESH.finditer(code)
    ]


# Run in one subprocess: `shardmesh WORDS --help` for each list of words, through
# the console script's entry point; None where argparse refuses the words.
_HELPS = """
import contextlib, io, json, sys
from runtime.cli.main import main
helps = {}
for words in json.loads(sys.stdin.read()):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main([*words, "--help"])
        except SystemExit as exc:
            code = exc.code
    helps[" ".join(words)] = out.getvalue() if code in (0, None) else None
print(json.dumps(helps))
"""
MAX_DEPTH = 3  # shardmesh voters add: two levels of commands, and room for one more


def cli_helps(paths: set[tuple[str, ...]]) -> dict[tuple[str, ...], str | None]:
    done = subprocess.run(
        [sys.executable, "-c", _HELPS],
        input=json.dumps(sorted(paths)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {tuple(k.split()): v for k, v in json.loads(done.stdout).items()}


def candidate_paths(words: list[str]) -> set[tuple[str, ...]]:
    """Every prefix of the leading command-like words: the helps a check may need."""
    depth = 0
    while depth < min(len(words), MAX_DEPTH) and WORD.fullmatch(words[depth]):
        depth += 1
    return {tuple(words[:k]) for k in range(depth + 1)}


def command_problem(words: list[str], helps: dict[tuple[str, ...], str | None]) -> str | None:
    """Why `shardmesh WORDS...` is not a command line the CLI takes, or None."""
    path: tuple[str, ...] = ()
    while True:
        text = helps.get(path)
        name = " ".join(("shardmesh", *path))
        if text is None:
            return f"`{name}` is not a command"
        choices = SUBCOMMANDS.search(text)
        rest = words[len(path) :]
        if not choices or not rest or not WORD.fullmatch(rest[0]):
            break
        if rest[0] not in choices.group(1).split(","):
            return f"`{name}` has no command {rest[0]!r}"
        path = (*path, rest[0])
    for flag in FLAG.findall(" ".join(words[len(path) :])):
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
            return f"`{name}` has no flag {flag}"
    return None


def make_targets(makefile: str) -> set[str]:
    return set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))


def command_docs(root: Path) -> dict[str, str]:
    """Repo-relative path -> text of the documents whose commands are checked."""
    return {
        path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
        for path in scanned_files(root)
        if path.suffix == ".md" and path.relative_to(root).as_posix().startswith(COMMAND_DOCS)
    }


def command_findings(
    root: Path, helps: dict[tuple[str, ...], str | None] | None = None
) -> list[Finding]:
    docs = command_docs(root)
    if helps is None:
        wanted = {
            p
            for t in docs.values()
            for _, c in command_lines(t)
            for p in candidate_paths(c.split())
        }
        helps = cli_helps(wanted)
    targets = make_targets((root / "Makefile").read_text(encoding="utf-8"))
    findings = []
    for rel, text in docs.items():
        for line, command in command_lines(text):
            problem = command_problem(command.split(), helps)
            if problem:
                findings.append(Finding(rel, line, f"{problem}: shardmesh {command}"))
        for line, code in code_of(text):
            for match in MAKE.finditer(code):
                if match.group(1) not in targets:
                    what = f"the Makefile has no target {match.group(1)}"
                    findings.append(Finding(rel, line, what))
    return _once(findings)


# -- the checks on the repository ------------------------------------------------------


def test_every_module_is_in_the_map() -> None:
    findings = unnamed_modules(REPO)
    assert not findings, _report(findings, f"modules missing from {MAP}")


def test_every_name_in_the_map_and_the_front_docs_exists() -> None:
    findings = [f for doc in NAMED_DOCS for f in broken_names(REPO, doc)]
    assert not findings, _report(findings, "documents name what is not there")


def test_every_cited_document_is_in_the_repository() -> None:
    findings = missing_citations(REPO)
    assert not findings, _report(findings, "citations of missing documents")


def test_nothing_cites_a_document_outside_the_repository() -> None:
    findings = outside_citations(REPO)
    assert not findings, _report(findings, "citations of documents outside the repository")


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    problems = readme_problems((REPO / README).read_text(encoding="utf-8"))
    assert not problems, f"{README}: " + "; ".join(problems)


def test_every_command_the_documents_show_is_real() -> None:
    findings = command_findings(REPO)
    assert not findings, _report(findings, "commands the CLI or the Makefile does not have")


def test_ci_runs_the_readmes_test_command() -> None:
    """`make test` is what the README tells a newcomer and what CI runs."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make test$", ci, re.MULTILINE), ".ci/run no longer runs `make test`"
    assert re.search(r"^test:", (REPO / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)


# -- the checkers themselves, on synthetic trees ---------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def _tree(root: Path, architecture: str, extra: dict[str, str] | None = None) -> None:
    _write(
        root,
        {
            "mesh/__init__.py": "",
            "mesh/wire.py": "def encode(): ...\nclass Envelope: ...\nLIMIT = 1\n",
            "runtime/__init__.py": "",
            "runtime/cli/__main__.py": "",
            "runtime/cli/main.py": "from runtime.cli import demo\n",
            "benchmarks/gossip.py": "",
            "docs/x.md": "",
            MAP: architecture,
            **(extra or {}),
        },
    )


def test_checker_finds_each_unnamed_module(tmp_path: Path) -> None:
    _tree(tmp_path, "| `mesh/wire.py` | the wire |\n")
    found = {f.path for f in unnamed_modules(tmp_path)}
    # __init__.py and __main__.py need no entry; a benchmark does.
    assert found == {"runtime/cli/main.py", "benchmarks/gossip.py"}, found
    _tree(tmp_path, "`mesh/wire.py`, `runtime/cli/main.py`, `benchmarks/gossip.py`\n")
    assert unnamed_modules(tmp_path) == []


def test_checker_finds_each_broken_name(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        "# Map\n"
        "`mesh/wire.py` and `mesh/gone.py`; [x](docs/x.md), [y](docs/y.md#part)\n"
        "`runtime/cli/` `runtime/web/` `tests/nothing.py` `STATE_DIR/operator.token`\n"
        "`mesh.wire.encode` `mesh.wire.Envelope.method` `mesh.wire.LIMIT` `mesh.wire.gone`\n"
        "`mesh.absent.X` `runtime.cli.main.demo` `trio.current_time` `/v1/network/status`\n",
    )
    found = {(f.line, f.what.split(",")[0].split(":")[0]) for f in broken_names(tmp_path)}
    assert found == {
        (2, "names mesh/gone.py"),
        (2, "names docs/y.md"),
        (3, "names runtime/web/"),
        (3, "names tests/nothing.py"),
        (4, "names mesh.wire.gone"),
        (5, "names mesh.absent.X"),
    }, found
    # A document's links may be relative to its folder; its paths are checked the same.
    _write(tmp_path, {"docs/ops.md": "[x](x.md) [m](../mesh/wire.py) `docs/x.md` [n](n.md)\n"})
    assert [f.what for f in broken_names(tmp_path, "docs/ops.md")] == [
        "names n.md, which does not exist"
    ]


def test_checker_finds_each_missing_citation(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        "",
        {
            "docs/adr/0001-a.md": "",
            "mesh/files.py": '"""See docs/adr/0001-a.md and docs/adr/0002-b.md."""\n',
            "docs/y.md": "[a](adr/0001-a.md) [x](x.md) [z](z.md) [m](../" + MAP + ")\n",
            "pyproject.toml": 'readme = "README.md"\n',
            "Makefile": "# docs/x.md says why\n# docs/none.md\n",
            "tests/test_schema.py": 'DOCS = ROOT / "docs" / "x.md"\n',
        },
    )
    found = {(f.path, f.line, f.what.split(",")[0]) for f in missing_citations(tmp_path)}
    assert found == {
        ("mesh/files.py", 1, "cites docs/adr/0002-b.md"),
        ("docs/y.md", 1, "cites z.md"),
        ("pyproject.toml", 1, "cites README.md"),
        ("Makefile", 2, "cites docs/none.md"),
    }, found


def test_checker_finds_each_outside_citation(tmp_path: Path) -> None:
    design, anchors = (f"{name}.md" for name in OUTSIDE_NAMES)
    _tree(
        tmp_path,
        "",
        {
            "consensus/raft.py": f'"""Built like RawNode ({design}, "The rule")."""\n',
            "benchmarks/gossip.py": f"# serf's model ({anchors})\n",
            "simulations/report.py": f'"""{OUTSIDE_NAMES[0]}\'s reports are JSON."""\n',
            "docs/y.md": "see [it](../../" + "shared/notes.md)\nand ../" + "shared/\n",
            "docs/z.md": "[ok](../" + MAP + ") and [up](../../elsewhere.md)\n",
        },
    )
    found = {(f.path, f.line) for f in outside_citations(tmp_path)}
    assert found == {
        ("consensus/raft.py", 1),
        ("benchmarks/gossip.py", 1),
        ("simulations/report.py", 1),
        ("docs/y.md", 1),
        ("docs/y.md", 2),
        ("docs/z.md", 1),
    }, found
    # Reported once, as outside, never also as missing.
    assert missing_citations(tmp_path) == []


def test_checker_holds_the_readme_to_its_shape() -> None:
    good = "# shardmesh\n\n```\nmake demo    # a swarm\nmake test    # everything\n```\n"
    assert readme_problems(good) == []
    assert readme_problems(good + "x\n" * README_MAX_LINES)[0].startswith("30")
    assert "text before" in readme_problems("# shardmesh\n\nIntro first.\n" + good)[0]
    swapped = good.replace("make demo", "make x")
    assert "first command block runs" in readme_problems(swapped)[0]
    assert "Layout section" in readme_problems(good + "## Layout\n")[0]
    assert readme_problems("# shardmesh\n") == ["no command block"]


def test_checker_finds_each_command_that_is_not_real(tmp_path: Path) -> None:
    """Against a stand-in CLI (the help texts) and a synthetic Makefile."""
    helps: dict[tuple[str, ...], str | None] = {
        (): "usage: shardmesh [-h] [--version]\n\ncommands:\n  {node,voters}\n",
        (
            "node",
        ): "usage: shardmesh node [-h] --listen H:P [--join ID@H:P] [--profile {lan,wan}]\n",
        (
            "voters",
        ): "usage: shardmesh voters [-h] {add,list} ...\n\nvoters commands:\n  {add,list}\n",
        ("voters", "add"): "usage: shardmesh voters add [-h] --api URL NODE_ID\n",
        ("voters", "list"): None,  # listed, but its --help fails
    }
    _write(
        tmp_path,
        {
            "Makefile": "demo: x\ntest: lint\n",
            "README.md": "```\n"
            "make demo\n"
            ".venv/bin/shardmesh node --listen 127.0.0.1:7001 \\\n"
            "    --join ID@H:P --joined\n"
            "shardmesh voters add --api URL 7c1e\n"
            "```\n"
            "Run `shardmesh serve DIR`, `make check`, `shardmesh voters drop X`,\n"
            "`shardmesh voters list`,\n"
            "`shardmesh --version`, `shardmesh voters add --api URL --token T`,\n"
            "`shardmesh-manifest.json` is a file, make a model, and the log says\n"
            "`shardmesh voters add: done`.\n",
            "docs/ops.md": "`shardmesh node [--listen H:P] --profile lan` and `make test`\n",
        },
    )
    found = {
        (f.path, f.line, f.what.split(": shardmesh")[0]) for f in command_findings(tmp_path, helps)
    }
    assert found == {
        ("README.md", 2, "`shardmesh node` has no flag --joined"),
        ("README.md", 7, "`shardmesh` has no command 'serve'"),
        ("README.md", 7, "the Makefile has no target check"),
        ("README.md", 7, "`shardmesh voters` has no command 'drop'"),
        ("README.md", 8, "`shardmesh voters list` is not a command"),
        ("README.md", 9, "`shardmesh voters add` has no flag --token"),
    }, found
