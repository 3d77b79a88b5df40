"""`shardmesh node --config FILE`, `shardmesh --version`, help on every flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cli.config_file import settable_actions, subcommand
from runtime.cli.main import build_parser, main, package_version, parse_arguments
from runtime.cli.node_process import node_options
from runtime.node.hostport import parse_hostport, parse_seed
from runtime.node.options import NodeOptions

SEED_A = f"{'a' * 64}@127.0.0.1:7000"
SEED_B = f"{'b' * 64}@10.0.0.2:7000"

NODE_TOML = f"""\
listen = "127.0.0.1:7001"
join = ["{SEED_A}"]
api = "127.0.0.1:8001"
data-listen = "127.0.0.1:7101"
state-dir = "state/n1"
profile = "local"
model = "models/tiny"
layers = "0:4"
recipe = "bf16"
backend = "torch"
swarm = "private"
capability-ttl = 300
capability-refresh = 60.5
max-sessions = 8
max-chats-per-client = 2
threads = 1
fault-injection = true
log-level = "DEBUG"
"""


def write(folder: Path, text: str, name: str = "node.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def options(*argv: str) -> NodeOptions:
    args = parse_arguments(build_parser(), ["node", *argv])
    return node_options(args)


def test_a_config_file_sets_every_option(tmp_path: Path) -> None:
    config = write(tmp_path / "etc", NODE_TOML)
    got = options("--config", str(config))
    assert got.listen == parse_hostport("127.0.0.1:7001")
    assert got.api == parse_hostport("127.0.0.1:8001")
    assert got.data_listen == parse_hostport("127.0.0.1:7101")
    assert got.joins == (parse_seed(SEED_A),)
    assert got.profile == "local"
    assert got.swarm == "private"
    assert got.fault_injection is True
    assert got.encrypted is True
    assert got.max_chats_per_client == 2
    assert got.backend == "torch"
    assert got.serve is not None
    assert got.serve.layers == (0, 4)
    assert got.serve.recipe == "bf16"
    assert got.serve.ttl_s == 300.0
    assert got.serve.refresh_s == 60.5
    assert got.serve.max_sessions == 8
    args = parse_arguments(build_parser(), ["node", "--config", str(config)])
    assert (args.threads, args.log_level) == (1, "DEBUG")


def test_relative_paths_in_the_file_are_relative_to_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "etc"
    (folder / "store").mkdir(parents=True)
    config = write(folder, NODE_TOML)
    monkeypatch.chdir(tmp_path)  # the file named relative to the working dir
    got = options("--config", "etc/node.toml")
    assert got.state_dir == folder / "state" / "n1"
    assert got.serve is not None and got.serve.model_dir == (folder / "models" / "tiny").resolve()
    write(folder, 'listen = "127.0.0.1:0"\nmodels = "store"\nstate-dir = "/abs/state"\n')
    got = options("--config", str(config))
    assert got.models == (folder / "store").resolve()
    assert got.state_dir == Path("/abs/state")
    # on the command line a relative path stays relative to the working dir
    got = options("--config", str(config), "--state-dir", "here")
    assert got.state_dir == Path("here")


def test_flags_on_the_command_line_override_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, NODE_TOML)
    got = options(
        *("--listen", "127.0.0.1:9001", "--swarm", "open", "--join", SEED_B),
        *("--config", str(config), "--max-sessions", "3", "--layers", "1:2"),
    )
    assert got.listen == parse_hostport("127.0.0.1:9001")
    assert got.swarm == "open"
    assert got.joins == (parse_seed(SEED_B),)  # the file's list is replaced, not extended
    assert got.serve is not None
    assert (got.serve.max_sessions, got.serve.layers) == (3, (1, 2))
    assert got.api == parse_hostport("127.0.0.1:8001")  # not given: the file's


def test_without_a_file_the_defaults_and_required_flags_stay() -> None:
    got = options("--listen", "127.0.0.1:0", "--state-dir", "s")
    assert (got.api_bind, got.joins, got.swarm, got.profile) == (
        parse_hostport("127.0.0.1:0"),
        (),
        "open",
        "lan",
    )
    with pytest.raises(SystemExit) as exited:
        parse_arguments(build_parser(), ["node", "--state-dir", "s"])
    assert exited.value.code == 2


def test_a_file_without_listen_still_needs_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, 'swarm = "private"\n')
    with pytest.raises(SystemExit) as exited:
        main(["node", "--config", str(config)])
    assert exited.value.code == 2
    assert "the following arguments are required: --listen" in capsys.readouterr().err
    got = options("--config", str(config), "--listen", "127.0.0.1:0")
    assert got.swarm == "private"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'frobnicate = "x"\n',
            "unknown key 'frobnicate' (keys are the flags of `shardmesh node --help` without --)",
        ),
        (
            'data_listen = "127.0.0.1:7101"\n',
            "unknown key 'data_listen': spell it 'data-listen', as the flag --data-listen",
        ),
        (
            "insecure-plaintext = true\n",
            "unknown key 'insecure-plaintext' (keys are the flags "
            "of `shardmesh node --help` without --)",
        ),
        (
            'config = "other.toml"\n',
            "unknown key 'config' (keys are the flags of `shardmesh node --help` without --)",
        ),
        ("listen = 7001\n", "listen: expected a string, not an integer"),
        ('max-sessions = "8"\n', "max-sessions: expected a number, not a string"),
        ("threads = true\n", "threads: expected a number, not a boolean"),
        ('auto-join = "yes"\n', "auto-join: expected true or false, not a string"),
        (f'join = "{SEED_A}"\n', "join: expected an array of strings, not a string"),
        ("join = [1]\n", "join: expected an array of strings, not an array"),
        ("[listen]\nhost = 1\n", "listen: expected a string, not a table"),
        ('listen = "nonsense"\n', "listen: 'nonsense' is not HOST:PORT"),
        (
            'join = ["ab@127.0.0.1:7000"]\n',
            "join: 'ab@127.0.0.1:7000': 'ab' is not a node id (64 hex digits)",
        ),
        ('layers = "4"\n', "layers: '4' is not A:B (e.g. 0:4)"),
        ("max-sessions = 2.5\n", "max-sessions: invalid int value: '2.5'"),
        ("threads = 0\n", "threads: 0 is not a positive integer"),
        (
            'profile = "fast"\n',
            "profile: invalid choice: 'fast' (choose from 'lan', 'wan', 'local')",
        ),
        ("listen = \n", "not valid TOML: Invalid value (at line 1, column 10)"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_key(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, text)
    with pytest.raises(SystemExit) as exited:
        main(["node", "--config", str(config), "--listen", "127.0.0.1:0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"shardmesh node: error: {config}: {message}\n"


def test_a_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(SystemExit) as exited:
        main(["node", "--config", str(missing)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"shardmesh node: error: {missing}: no such file\n"


def test_a_usage_error_on_the_command_line_is_reported_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, NODE_TOML)
    with pytest.raises(SystemExit) as exited:
        main(["node", "--config", str(config), "--threads", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: shardmesh node" in err
    assert "argument --threads: 0 is not a positive integer" in err


def test_every_visible_flag_is_a_key_and_no_hidden_one_is() -> None:
    node = subcommand(build_parser(), "node")
    keys = settable_actions(node)
    flags = {
        flag[2:]
        for action in node._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--")
    }
    assert set(keys) == flags - {"help", "config"}
    assert "insecure-plaintext" not in keys


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*path, name))
    return found


def test_every_flag_of_every_command_has_help() -> None:
    commands = _commands(build_parser())
    assert {" ".join(path) for path, _ in commands} >= {"", "node", "manifest build", "doctor"}
    missing = [
        f"{' '.join(('shardmesh', *path))} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in commands
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
        and not (action.help or "").strip()
    ]
    assert missing == []


def test_version_prints_the_package_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"shardmesh {package_version()}\n"
    assert package_version()[0].isdigit()  # installed in the venv: the real version


def test_an_advertised_node_serves_its_api_where_it_is_advertised() -> None:
    parser = build_parser()

    def api_bind(*argv: str) -> str:
        return node_options(parser.parse_args(["node", *argv])).api_bind.text()

    assert api_bind("--listen", "127.0.0.1:0") == "127.0.0.1:0"
    # Listening on every interface and advertising a public name: the API
    # must be reachable there too, not only on this machine's loopback.
    assert api_bind("--listen", "0.0.0.0:7001", "--advertise", "node.example") == "0.0.0.0:0"
    assert api_bind("--listen", "10.0.0.5:7001", "--advertise", "10.0.0.5") == "10.0.0.5:0"
    # An explicit --api is the operator's choice.
    assert api_bind("--listen", "0.0.0.0:7001", "--advertise", "h", "--api", "127.0.0.1:8") == (
        "127.0.0.1:8"
    )
