"""`runtime.model.hub`: a hub model fetched file by file, only what a span needs.

Against `tests.fake_hub.FakeHub`, which answers huggingface_hub's own
requests (HEAD and GET on `/{repo}/resolve/{revision}/{file}`) for tiny
models written as several safetensors files with an index.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from runtime.model.hub import HUB_STATE_DIR, HubError, HubModel, HubSource
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import INDEX_FILE, SINGLE_FILE, SafetensorsReader
from tests.fake_hub import COMMIT, FakeHub

REPO = "volunteers/tiny"
METADATA = {"config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE}
"""What every node fetches first: the tiny model has no other tokenizer files."""


def shard(k: int, of: int = 4) -> str:
    return f"model-{k:05d}-of-{of:05d}.safetensors"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer model in 4 weight files: file k holds layer k-1, the first
    also the embeddings, the last the final norm and LM head."""
    folder = tmp_path_factory.mktemp("hub") / "tiny"
    return make_tiny_model(folder, layers=4, shards=4, with_manifest=False)


def test_only_the_files_of_the_span_are_fetched(repo: Path, tmp_path: Path) -> None:
    with FakeHub({REPO: repo}) as hub:
        model = HubModel(HubSource.parse(f"hf:{REPO}"), tmp_path, endpoint=hub.url)
        model.fetch_metadata()
        assert hub.fetched() == METADATA
        assert model.files_for_span(2, 4) == [shard(3), shard(4)]
        assert model.fetch_span(2, 4) == [shard(3), shard(4)]
        assert hub.fetched() == METADATA | {shard(3), shard(4)}
        # Every file came at the commit "main" resolved to, not at "main".
        assert {rev for method, rev, _ in hub.requests if method == "GET"} == {COMMIT}

        # The folder's index lists what is on disk: a reader opens it, and
        # the span's tensors read as the hub's files hold them.
        local = SafetensorsReader(tmp_path)
        assert {local.file_of(name).name for name in local.names()} == {shard(3), shard(4)}
        name = "model.layers.3.mlp.up_proj.weight"
        assert local.read([name])[name].data == SafetensorsReader(repo).read([name])[name].data
        hub_index = json.loads((tmp_path / HUB_STATE_DIR / INDEX_FILE).read_text())
        assert hub_index == json.loads((repo / INDEX_FILE).read_text())

        model.fetch_span(0, 1)  # the embeddings live with layer 0
        assert hub.fetched() == METADATA | {shard(1), shard(3), shard(4)}

        # Again, in a new process' worth of state: nothing is fetched twice.
        gets = len([r for r in hub.requests if r[0] == "GET"])
        again = HubModel(HubSource.parse(f"hf:{REPO}@main"), tmp_path, endpoint=hub.url)
        again.fetch_metadata()
        again.fetch_span(2, 4)
        assert len([r for r in hub.requests if r[0] == "GET"]) == gets


def test_an_unsharded_checkpoint_comes_whole_with_the_metadata(tmp_path: Path) -> None:
    single = make_tiny_model(tmp_path / "repo", layers=2, with_manifest=False)
    with FakeHub({REPO: single}) as hub:
        model = HubModel(HubSource.parse(f"hf:{REPO}"), tmp_path / "out", endpoint=hub.url)
        model.fetch_metadata()
        assert hub.fetched() == {"config.json", "tokenizer.json", "tokenizer_config.json"} | {
            SINGLE_FILE
        }
        assert model.files_for_span(1, 2) == [SINGLE_FILE]
        assert model.tensor_names() == SafetensorsReader(single).names()


def test_what_the_hub_cannot_give_is_one_line(repo: Path, tmp_path: Path) -> None:
    with FakeHub({REPO: repo}) as hub:
        for text, says in [
            ("hf:volunteers/nothing", "no such repository"),
            (f"hf:{REPO}@v9", "has no revision 'v9'"),
        ]:
            with pytest.raises(HubError, match=says) as refused:
                HubModel(HubSource.parse(text), tmp_path, endpoint=hub.url).fetch_metadata()
            assert "\n" not in str(refused.value)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(HubError, match=r"fetching config\.json failed"):
        HubModel(
            HubSource.parse(f"hf:{REPO}"), tmp_path, endpoint=f"http://127.0.0.1:{port}"
        ).fetch_metadata()


def test_hub_sources_parse() -> None:
    assert HubSource.parse("hf:Qwen/Qwen3-0.6B") == HubSource("Qwen/Qwen3-0.6B", "main")
    assert HubSource.parse("hf:Qwen/Qwen3-0.6B@v1.0").revision == "v1.0"
    assert HubSource.parse("hf:Qwen/Qwen3-0.6B").name == "Qwen3-0.6B"
    for bad in ["Qwen/Qwen3-0.6B", "hf:Qwen3", "hf:/x", "hf:a/b/c", "hf:a/b@"]:
        with pytest.raises(ValueError, match="hf:"):
            HubSource.parse(bad)
