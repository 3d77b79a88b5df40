"""`shardmesh doctor --model hf:REPO`: the span's weight files fetched, then
the doctor as for a folder (a folder's doctor: tests/runtime/model/test_doctor.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.cli.main import main
from runtime.model.weights import INDEX_FILE
from tests.fake_hub import FakeHub
from tests.runtime.cli.conftest import (
    HUB_METADATA,
    HUB_MODEL,
    hub_folder,
    install_manifest_of,
    shard_file,
)

DOCTOR = ["doctor", "--model", HUB_MODEL, "--recipe", "fp32", "--backend", "torch"]


def test_a_hub_models_shard_is_checked_once_its_files_are_fetched(
    hub: FakeHub, hub_built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = hub_folder(tmp_path)
    assert main([*DOCTOR, "--layers", "0:2", "--no-measure", "--json"]) == 1
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(
            "shardmesh doctor: error: --model: hf:volunteers/tiny@main: no shardmesh manifest in "
            f"{folder}; build it"
        )
    )
    install_manifest_of(hub_built, folder)

    assert main([*DOCTOR, "--layers", "0:99", "--no-measure", "--json"]) == 1
    refused = json.loads(capsys.readouterr().out)
    assert (refused["admitted"], refused["reason"]) == (False, "span_out_of_range")
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE}  # no weights for a span that is not

    assert main([*DOCTOR, "--layers", "0:2", "--no-measure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["admitted"] is True
    assert hub.fetched() == HUB_METADATA | {INDEX_FILE, shard_file(1)}
