"""`runtime.cli.flags`: the flag groups several commands share, defined once."""

from __future__ import annotations

import argparse

import pytest

from runtime.cli.config_file import subcommand
from runtime.cli.flags import NODE_COMMANDS, SERVE_LISTEN, api_flag, node_flags, token_flags
from runtime.cli.main import build_parser


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings if flag.startswith("--")}


def test_the_node_flags_mean_the_same_in_every_command_that_runs_a_node() -> None:
    parser = build_parser()
    alone = argparse.ArgumentParser()
    node_flags(alone, command="node")
    shared = set(_flags(alone)) - {"--help"}
    assert {"--config", "--listen", "--join", "--max-memory", "--log-level"} <= shared
    for command in NODE_COMMANDS:
        flags = _flags(subcommand(parser, command))
        assert shared <= set(flags), command
        for flag in shared - {"--listen"}:
            mine, theirs = flags[flag], _flags(alone)[flag]
            assert (mine.dest, mine.type, mine.default, mine.help) == (
                theirs.dest,
                theirs.type,
                theirs.default,
                theirs.help,
            ), (command, flag)


def test_only_serve_listens_by_default() -> None:
    node = _flags(subcommand(build_parser(), "node"))["--listen"]
    serve = _flags(subcommand(build_parser(), "serve"))["--listen"]
    assert node.required and node.default is None
    assert not serve.required and serve.default == SERVE_LISTEN
    assert "(default 127.0.0.1:0: this machine only)" in (serve.help or "")


def test_the_token_flags_are_one_or_the_other(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="admin")
    token_flags(parser)
    args = parser.parse_args(["--state-dir", "s"])
    assert (args.token_file, str(args.state_dir)) == (None, "s")
    with pytest.raises(SystemExit):
        parser.parse_args(["--token-file", "t", "--state-dir", "s"])
    assert "not allowed with argument" in capsys.readouterr().err
    for command in ("policy", "invite"):
        assert {"--token-file", "--state-dir"} <= set(_flags(subcommand(build_parser(), command)))


def test_the_api_flag_is_required_and_takes_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="ask")
    api_flag(parser, "the node")
    assert parser.parse_args(["--api", "127.0.0.1:8"]).api == "http://127.0.0.1:8"
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "the following arguments are required: --api" in capsys.readouterr().err
