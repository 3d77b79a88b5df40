"""`shardmesh node`: usage errors, start-up errors, and `--model hf:REPO`."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli.commands import node as node_command
from runtime.cli.localswarm import LocalSwarm
from runtime.cli.main import main
from runtime.model.weights import INDEX_FILE
from runtime.node.options import NodeOptions
from tests.fake_hub import FakeHub
from tests.runtime.cli.conftest import (
    HUB_METADATA,
    HUB_MODEL,
    hub_folder,
    install_manifest_of,
    shard_file,
)
from tests.runtime.cli.test_main import assert_usage_error, run_cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["node"], "--listen"),
        (["node", "--listen", "nonsense"], "is not HOST:PORT"),
        (["node", "--listen", "127.0.0.1:99999"], "out of range"),
        (["node", "--listen", "127.0.0.1:0", "--join", "127.0.0.1:7000"], "NODE_ID@HOST:PORT"),
        (["node", "--join", "ab@127.0.0.1:7000"], "not a node id"),
        (["node", "--join", f"{'a' * 64}@127.0.0.1:0"], "out of range"),
        (["node", "--listen", "127.0.0.1:0", "--profile", "fast"], "invalid choice: 'fast'"),
        (["node", "--listen", "0.0.0.0:7000"], "--advertise"),
    ],
)
def test_bad_arguments_exit_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys)


# --- node start-up errors ------------------------------------------------------


async def test_second_node_on_one_state_dir_or_port_exits_1(swarm: LocalSwarm) -> None:
    node = swarm.new_node()
    await swarm.start_ready(node)

    same_dir = await run_cli("node", "--listen", "127.0.0.1:0", "--state-dir", str(node.state_dir))
    assert same_dir.returncode == 1
    assert b"is in use by another shardmesh node" in same_dir.stderr

    other_dir = str(swarm.root / "other")
    same_port = await run_cli("node", "--listen", node.control, "--state-dir", other_dir)
    assert same_port.returncode == 1
    assert b"cannot listen on" in same_port.stderr

    api = node.api.removeprefix("http://")
    same_api = await run_cli(
        "node", "--listen", "127.0.0.1:0", "--api", api, "--state-dir", other_dir
    )
    assert same_api.returncode == 1
    assert b"cannot serve the API" in same_api.stderr
    assert node.running


# --- --model hf:REPO -----------------------------------------------------------


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[NodeOptions]:
    """The options of every node `main` would start (none is started)."""
    options: list[NodeOptions] = []

    def run_node(given: NodeOptions, command: str) -> int:
        options.append(given)
        return 0

    monkeypatch.setattr(node_command, "run_node", run_node)
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")  # what the command sets, undone after
    return options


def test_a_hub_model_shard_fetches_only_its_files_then_serves_the_cached_folder(
    hub: FakeHub,
    hub_built: Path,
    tmp_path: Path,
    started: list[NodeOptions],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["node", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
            "--model", HUB_MODEL, "--layers", "0:2", "--backend", "torch"]  # fmt: skip
    folder = hub_folder(tmp_path)
    assert main(argv) == 2  # no manifest: before any weights, one line after the progress
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"shardmesh node: error: --model: hf:volunteers/tiny@main: no shardmesh manifest in "
        f"{folder}; build it with `shardmesh manifest build hf:volunteers/tiny@main` (fetches "
        "every weight file), or let `shardmesh serve --model hf:volunteers/tiny@main` take "
        "the swarm's"
    )
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE} and started == []

    install_manifest_of(hub_built, folder)
    assert main(argv) == 0
    (options,) = started
    assert options.serve is not None and options.serve.model_dir == folder.resolve()
    assert options.serve.layers == (0, 2)
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE, shard_file(1)}

    assert main([*argv[:-4], "--layers", "0:99", "--backend", "torch"]) == 2  # the preflight's
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("shardmesh node: error: --model: layer span [0, 99)")


def test_a_hub_id_without_hf_is_a_usage_error(
    tmp_path: Path, started: list[NodeOptions], capsys: pytest.CaptureFixture[str]
) -> None:
    state = ["--state-dir", str(tmp_path / "state")]
    assert_usage_error(
        [
            "node",
            "--listen",
            "127.0.0.1:0",
            *state,
            "--model",
            "Qwen/Qwen3-0.6B",
            "--layers",
            "0:2",
        ],
        "'Qwen/Qwen3-0.6B' is not hf:REPO[@REVISION] (the hub's model is hf:Qwen/Qwen3-0.6B)",
        capsys,
    )
    assert_usage_error(
        ["node", "--listen", "127.0.0.1:0", "--model", "hf:Qwen", "--layers", "0:2"],
        "argument --model: 'hf:Qwen' is not hf:OWNER/NAME[@REVISION]",
        capsys,
    )
    assert started == []
