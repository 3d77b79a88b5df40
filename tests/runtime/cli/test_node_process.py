"""`runtime.cli.node_process`: the options `node` and `serve` flags ask for,
and the environment a node process computes in."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest

from runtime.cli.main import build_parser
from runtime.cli.node_process import COMPUTE_ENV_DEFAULTS, configure_node_process, node_options


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["node", "--listen", "127.0.0.1:0", *argv])


def test_a_hub_models_shard_is_served_from_its_cached_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    options = node_options(parse("--model", "hf:Qwen/Qwen3-0.6B@v1", "--layers", "0:4"))
    assert options.serve is not None
    assert options.serve.model_dir == tmp_path / "shardmesh" / "hub" / "Qwen" / "Qwen3-0.6B@v1"
    folder = node_options(parse("--model", str(tmp_path), "--layers", "0:4")).serve
    assert folder is not None and folder.model_dir == tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "hf:a/b"], "--model and --layers go together"),
        (["--layers", "0:2"], "--model and --layers go together"),
        (["--model", ".", "--layers", "0:2", "--auto-join"], "--auto-join is for model-less"),
        (["--models", "/nonexistent/store"], "--models /nonexistent/store: not a directory"),
    ],
)
def test_flags_that_cannot_work_together_are_a_value_error(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        node_options(parse(*argv))


def test_the_process_computes_with_a_short_spin_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    configure_node_process(parse("--threads", "2"))
    assert os.environ["GOMP_SPINCOUNT"] == COMPUTE_ENV_DEFAULTS["GOMP_SPINCOUNT"]
    assert os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")  # an operator's own setting wins
    configure_node_process(parse())
    assert os.environ["GOMP_SPINCOUNT"] == "0" and os.environ["OMP_NUM_THREADS"] == "2"
