"""`runtime.cli.main`: the parser built from the command modules, the
dispatch to a command's run function, and a fast `--help`. Also the helpers
the command tests share (`run_cli`, `assert_usage_error`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from runtime.cli.commands import manifest, status, voters
from runtime.cli.main import COMMANDS, build_parser, main

CLI_TIMEOUT_S = 30.0
HEAVY_MODULES = (
    "numpy",
    "torch",
    "transformers",
    "mlx",
    "trio",
    "httpx",
    "huggingface_hub",
    "cryptography",
    "runtime.node.daemon",
    "simulations",
)
"""What `shardmesh --help` must not import: each costs from tens of
milliseconds (httpx) to seconds (torch)."""


def shardmesh_command() -> list[str]:
    """The installed console script when there is one (what users run),
    else the module (same code)."""
    script = Path(sys.executable).with_name("shardmesh")
    return [str(script)] if script.exists() else [sys.executable, "-m", "runtime.cli"]


async def run_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(CLI_TIMEOUT_S):
        return await trio.run_process(
            [*shardmesh_command(), *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


def assert_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], usage: str = "shardmesh"
) -> None:
    """`main(argv)` exits 2 printing `usage` (the command's) and `message`."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: {usage}" in err
    assert message in err


# --- usage errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys)


async def test_console_script_usage_error() -> None:
    result = await run_cli()
    assert result.returncode == 2
    assert b"usage: shardmesh" in result.stderr
    for command in (b"node", b"status", b"demo", b"simulate", b"tiny-model", b"doctor"):
        assert command in result.stderr


# --- dispatch ---------------------------------------------------------------------


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command a command line can end in (`manifest build`, not `manifest`)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    return [leaf for name, sub in subs[0].choices.items() for leaf in _leaves(sub, (*path, name))]


def test_every_command_names_a_run_function_of_its_own_module() -> None:
    leaves = _leaves(build_parser())
    assert {" ".join(path) for path, _ in leaves} >= {"node", "voters add", "manifest build"}
    modules = {command.__name__ for command in COMMANDS}
    for path, parser in leaves:
        run = parser.get_default("run")
        assert callable(run), path
        assert run.__module__ in modules, path


def test_the_commands_are_listed_in_the_order_help_shows_them() -> None:
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(commands.choices) == [
        "node", "serve", "status", "chat", "demo", "simulate", "tiny-model", "manifest",
        "policy", "voters", "invite", "doctor", "lab",
    ]  # fmt: skip


def test_main_calls_the_chosen_run_function_with_the_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[argparse.Namespace, argparse.ArgumentParser]] = []

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        calls.append((args, parser))
        return 7

    monkeypatch.setattr(status, "run", run)
    assert main(["status", "--api", "127.0.0.1:1"]) == 7
    ((args, parser),) = calls
    assert args.command == "status" and args.api == "http://127.0.0.1:1"
    assert parser.prog == "shardmesh"  # the top-level parser, for a usage error


def test_nested_commands_dispatch_to_their_own_run_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []
    for module, name in (
        (voters, "run_list"),
        (voters, "run_add"),
        (voters, "run_refound"),
        (manifest, "run_build"),
    ):
        monkeypatch.setattr(module, name, lambda args, parser, name=name: ran.append(name) or 0)
    api = ("--api", "127.0.0.1:1")
    assert main(["voters", "list", *api]) == 0
    assert main(["voters", "add", "a" * 64, *api]) == 0
    assert main(["voters", "refound", *api]) == 0
    assert main(["manifest", "build", "."]) == 0
    assert ran == ["run_list", "run_add", "run_refound", "run_build"]


def test_help_imports_nothing_heavy() -> None:
    """`shardmesh --help` (and every command's) builds the whole parser:
    the command modules defer what running them needs."""
    probe = (
        "import sys, contextlib, io\n"
        "from runtime.cli.main import main\n"
        "for argv in ([], ['node'], ['serve'], ['doctor'], ['manifest', 'build']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([*argv, '--help'])\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = result.stdout.split()
    heavy = [m for m in loaded for h in HEAVY_MODULES if m == h or m.startswith(f"{h}.")]
    assert heavy == []
