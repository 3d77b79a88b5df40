"""`shardmesh serve` without processes: what it refuses before joining, and
the checks a member's manifest must pass before a volunteer's copy takes it
(`runtime.model.peer_manifest`, `runtime.model.manifest.install_manifest`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.cli.commands import serve as serve_command
from runtime.cli.main import build_parser, main, parse_arguments
from runtime.cli.model_source import IMPORTED_DIR
from runtime.cli.node_process import node_options
from runtime.model.hub import HubSource
from runtime.model.manifest import (
    GOLDEN_FILE,
    MANIFEST_FILE,
    ManifestError,
    install_manifest,
    load_manifest,
    tensor_table,
)
from runtime.model.peer_manifest import manifest_mismatch
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import INDEX_FILE
from runtime.node.options import NodeOptions
from tests.fake_hub import COMMIT, FakeHub
from tests.runtime.cli.conftest import HUB_METADATA, HUB_MODEL, HUB_REPO, hub_folder
from tests.runtime.cli.test_main import assert_usage_error


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with its manifest: the member's copy."""
    return make_tiny_model(tmp_path_factory.mktemp("member") / "tiny", layers=2)


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> Path:
    """The same model without a manifest: a volunteer's copy."""
    return Path(
        shutil.copytree(built, tmp_path / "mine", ignore=shutil.ignore_patterns("shardmesh-*"))
    )


def test_the_members_manifest_describes_an_identical_copy(built: Path, copy: Path) -> None:
    manifest = load_manifest(built)
    assert manifest_mismatch(manifest, copy, tensor_table(copy)) is None
    assert manifest_mismatch(manifest, copy, sorted(manifest["tensors"])) is None  # names only


def test_a_manifest_that_is_not_these_files_is_refused_saying_why(built: Path, copy: Path) -> None:
    manifest = load_manifest(built)
    table = tensor_table(copy)
    forged = json.loads(json.dumps(manifest))
    forged["tensors"]["model.layers.1.mlp.up_proj.weight"]["sha256"] = "0" * 64
    assert manifest_mismatch(forged, copy, table) == (
        "tensors differ from this folder's: model.layers.1.mlp.up_proj.weight"
    )
    fewer = json.loads(json.dumps(manifest))
    del fewer["tensors"]["model.norm.weight"]
    assert "not listed: model.norm.weight" in (manifest_mismatch(fewer, copy, table) or "")
    lying = {**manifest, "num_layers": 1}
    assert manifest_mismatch(lying, copy, table) == "its num_layers disagree with config.json"
    assert manifest_mismatch({"format": "?"}, copy, table) is not None

    (copy / "tokenizer_config.json").write_text("{}")
    assert manifest_mismatch(manifest, copy, table) == (
        "tokenizer files differ: tokenizer_config.json"
    )
    (copy / "config.json").write_text(
        json.dumps({**json.loads((built / "config.json").read_text()), "x": 1})
    )
    assert manifest_mismatch(manifest, copy, table) == "its config.json is not this folder's"


def test_installed_goldens_must_hash_as_the_manifest_says(built: Path, copy: Path) -> None:
    manifest = load_manifest(built)
    golden = (built / GOLDEN_FILE).read_bytes()
    with pytest.raises(ManifestError, match="do not hash"):
        install_manifest(copy, manifest, golden[:-1] + bytes([golden[-1] ^ 1]))
    elsewhere = {**manifest, "golden": {**manifest["golden"], "file": "../escaped"}}
    with pytest.raises(ManifestError, match="not in"):
        install_manifest(copy, elsewhere, golden)
    assert not (copy / MANIFEST_FILE).exists() and not (copy.parent / "escaped").exists()
    install_manifest(copy, manifest, golden)
    assert load_manifest(copy) == manifest
    assert (copy / GOLDEN_FILE).read_bytes() == golden


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve"], "name a MODEL_DIR or FILE.gguf, or a hub model with --model hf:REPO"),
        (["serve", "--model", "Qwen/Qwen3-0.6B"], "is not hf:REPO[@REVISION]"),
        (["serve", "x", "--max-memory", "0"], "is not a size"),
        (["serve", "x", "--max-memory", "lots"], "is not a size"),
    ],
)
def test_bad_serve_arguments_exit_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys, usage="shardmesh serve")


def test_a_gguf_file_that_is_not_there_or_not_gguf_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = ["--state-dir", str(tmp_path / "state")]
    assert main(["serve", str(tmp_path / "nowhere.gguf"), *state]) == 2
    err = capsys.readouterr().err
    assert err == f"shardmesh serve: error: {tmp_path / 'nowhere.gguf'}: no such GGUF file\n"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    assert main(["serve", "--model", str(broken), *state]) == 2
    assert "cannot import this GGUF file" in capsys.readouterr().err
    assert not list((tmp_path / "state" / IMPORTED_DIR).iterdir())  # no half import


def test_a_folder_that_cannot_be_served_is_one_line_and_exit_2(
    copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = ["--state-dir", str(tmp_path / "state")]
    assert main(["serve", str(tmp_path / "nowhere"), *state]) == 2
    assert capsys.readouterr().err == (
        f"shardmesh serve: error: {tmp_path / 'nowhere'}: no such model folder\n"
    )
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    assert main(["serve", str(copy), *state]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardmesh serve: error: ") and err.count("\n") == 1
    assert "unsupported architecture ['GPT2LMHeadModel']" in err
    assert not (tmp_path / "state").exists()  # refused before the node started


def test_serve_shares_the_node_flags_and_always_auto_joins(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", str(tmp_path), "--max-memory", "1.5G", "--recipe", "bf16", "--join",
         f"{'a' * 64}@127.0.0.1:7001"]
    )  # fmt: skip
    options = node_options(args)
    assert options.auto_join and options.serve is None and options.models is None
    assert options.max_memory == 3 * 2**29 and options.recipe == "bf16"
    assert options.listen.text() == "127.0.0.1:0"
    assert len(options.joins) == 1
    node = node_options(build_parser().parse_args(["node", "--listen", "127.0.0.1:0"]))
    assert node.recipe is None and not node.auto_join
    for pinning in (["--layers", "0:2"], ["--models", "."], ["--auto-join"]):
        with pytest.raises(SystemExit):  # serve picks its span: nothing pins one
            build_parser().parse_args(["serve", str(tmp_path), *pinning])


def test_serve_reads_the_node_flags_from_its_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('max-memory = "2G"\nprofile = "local"\nstate-dir = "state"\n')
    args = parse_arguments(build_parser(), ["serve", str(tmp_path), "--config", str(config)])
    options = node_options(args)
    assert options.max_memory == 2 * 2**30 and options.profile == "local"
    assert options.state_dir == tmp_path / "state"
    config.write_text('layers = "0:2"\n')
    with pytest.raises(SystemExit) as exited:
        parse_arguments(build_parser(), ["serve", str(tmp_path), "--config", str(config)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"shardmesh serve: error: {config}: unknown key 'layers' "
        "(keys are the flags of `shardmesh serve --help` without --)\n"
    )


# --- --model: a folder or hf:REPO, as for every command ------------------------


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[NodeOptions]:
    """The options of every node `main` would start (none is started)."""
    options: list[NodeOptions] = []

    def run_node(given: NodeOptions, command: str) -> int:
        options.append(given)
        return 0

    monkeypatch.setattr(serve_command, "run_node", run_node)
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")  # what the command sets, undone after
    return options


def test_model_names_a_folder_as_model_dir_does(
    built: Path, tmp_path: Path, started: list[NodeOptions], capsys: pytest.CaptureFixture[str]
) -> None:
    state = ["--state-dir", str(tmp_path / "state"), "--backend", "torch"]
    assert main(["serve", str(built), *state]) == 0
    assert main(["serve", "--model", str(built), *state]) == 0
    by_dir, by_model = (options.provision for options in started)
    assert by_dir == by_model and by_dir is not None
    assert (by_dir.model_dir, by_dir.hub) == (built.resolve(), None)
    assert_usage_error(
        ["serve", str(built), "--model", str(built), *state],
        "name the model folder once: MODEL_DIR or --model DIR",
        capsys,
        usage="shardmesh serve",
    )


def test_a_hub_model_fetches_only_its_metadata_before_the_node_starts(
    hub: FakeHub, tmp_path: Path, started: list[NodeOptions]
) -> None:
    state = ["--state-dir", str(tmp_path / "state"), "--backend", "torch"]
    assert main(["serve", "--model", HUB_MODEL, *state]) == 0
    mine = tmp_path / "mine"
    assert main(["serve", str(mine), "--model", f"{HUB_MODEL}@{COMMIT}", *state]) == 0
    cached, chosen = (options.provision for options in started)
    assert cached is not None and chosen is not None
    assert (cached.model_dir, cached.hub) == (hub_folder(tmp_path).resolve(), HubSource(HUB_REPO))
    assert (chosen.model_dir, chosen.hub) == (mine.resolve(), HubSource(HUB_REPO, COMMIT))
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE}
