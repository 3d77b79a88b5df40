"""`shardmesh serve`: a volunteer's one command, as real processes on loopback.

A founder serves a model folder that has no manifest yet and answers a chat
through the OpenAI API; a joining copy of other weights refuses the swarm's
manifest and builds its own; volunteers who join take the swarm's manifest
from a member instead of building one and take the layers the swarm lacks,
one of them fetching from a hub (`tests.fake_hub`) only the files of its
layers; a node that no layer fits stops with why.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from runtime.cli.localswarm import LocalNode, LocalSwarm, Views
from runtime.model.manifest import GOLDEN_FILE, MANIFEST_FILE, load_manifest, manifest_digest
from runtime.model.store import model_facts
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import INDEX_FILE
from tests.fake_hub import FakeHub
from tests.swarm_helpers import START_TIMEOUT_S, assert_no_internal_errors, wait_for

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Who serves this?"}]
SERVE_TIMEOUT_S = 60.0
"""From a node's start to its span admitted: the manifest (fetched or a
tiny model's build), the backend's import, the placement round, the doctor;
on a loaded 2-core machine."""
EXIT_TIMEOUT_S = 60.0
LOG_TIMEOUT_S = 10.0
POLL_S = 0.1
REPO = "volunteers/tiny"


def without_manifest(model: Path, to: Path) -> Path:
    """A volunteer's copy of `model`: the same files, no manifest."""
    return Path(shutil.copytree(model, to, ignore=shutil.ignore_patterns("shardmesh-*")))


async def logged(node: LocalNode, text: str) -> str:
    """`node`'s log once it holds `text` (the node writes a line a moment
    after the state the test waited for); the whole log."""
    with trio.move_on_after(LOG_TIMEOUT_S):
        while text not in (log := node.log_path.read_text()):
            await trio.sleep(POLL_S)
        return log
    raise AssertionError(f"{node.name} never logged {text!r}:\n{node.log_tail()}")


def served(observer: LocalNode, nodes: list[LocalNode]) -> Callable[[Views], bool]:
    """`observer` sees MODEL fully covered by admitted `nodes`."""

    def check(views: Views) -> bool:
        coverage = (views.get(observer.name) or {}).get("coverage", {}).get(MODEL)
        if coverage is None or coverage["gaps"]:
            return False
        return {n.node_id for n in nodes} <= {n["node_id"] for n in coverage["nodes"]}

    return check


def spans(view: dict[str, Any] | None) -> dict[str, tuple[list[int], str]]:
    """node_id -> (layers, tier) of MODEL's assignments in a node's ledger."""
    return {
        entry["node_id"]: (entry["layers"], entry["tier"])
        for entry in (view or {}).get("ledger", [])
        if entry["model"] == MODEL
    }


def chat(api: str) -> tuple[str, list[str]]:
    """One completion through the official OpenAI client: (text, route)."""
    import openai

    client = openai.OpenAI(base_url=api + "/v1", api_key="unused")
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )
    extra = answer.model_extra or {}
    return answer.choices[0].message.content or "", extra["shardmesh"]["route"]


async def test_a_founder_serves_a_bare_model_folder_in_one_command(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    folder = make_tiny_model(tmp_path / MODEL, layers=4, with_manifest=False)
    founder = swarm.new_node("founder", command=["serve", str(folder)])
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], served(founder, [founder]), SERVE_TIMEOUT_S, "served")

    text, route = await trio.to_thread.run_sync(chat, founder.api)
    assert text and route == [founder.node_id]
    assert spans(await swarm.status(founder)) == {founder.node_id: ([0, 4], "bootstrap")}
    log = await logged(founder, f"serving {MODEL} layers 0:4 (fp32); chat at {founder.api}/v1")
    assert "building the manifest of" in log and "manifest build: done in" in log
    assert (folder / MANIFEST_FILE).is_file()

    # Other weights with the same config and tokenizer (a fine-tune, or a
    # forgery): the founder's manifest is refused, and one is built here.
    variant_dir = make_tiny_model(tmp_path / "variant", layers=4, seed=1, with_manifest=False)
    variant = swarm.new_node(
        "variant", args=["--name", "variant"], command=["serve", str(variant_dir)]
    )
    await swarm.start_ready(variant, [founder.seed], timeout=START_TIMEOUT_S)

    def variant_served(views: Views) -> bool:
        coverage = (views.get("founder") or {}).get("coverage", {}).get("variant")
        return coverage is not None and not coverage["gaps"]

    await wait_for(swarm, [founder], variant_served, SERVE_TIMEOUT_S, "the variant served")
    log = await logged(variant, "serving variant layers 0:4 (fp32)")
    assert (
        f"refused the manifest of {MODEL} from node {founder.node_id[:12]}: "
        "tensors differ from this folder's: " in log
    )
    assert "manifest build: done in" in log
    assert manifest_digest(load_manifest(variant_dir)) != manifest_digest(load_manifest(folder))
    await assert_no_internal_errors(swarm, [founder, variant])

    # The same command again after a restart: its manifest and its pinned
    # span are kept, and it serves them again.
    assert await swarm.stop(founder) == 0
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], served(founder, [founder]), SERVE_TIMEOUT_S, "served again")
    log = await logged(founder, "model tiny (digest")
    assert log.count("manifest build: done in") == 1
    assert spans(await swarm.status(founder)) == {founder.node_id: ([0, 4], "bootstrap")}


@pytest.mark.slow
async def test_volunteers_take_the_swarms_manifest_and_the_layers_it_lacks(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    # Six layers in six files; every node offers memory for two layers.
    model = make_tiny_model(tmp_path / "founder" / MODEL, layers=6, shards=6)
    facts = model_facts(load_manifest(model))
    two_layers = str(facts.overhead_bytes + 2 * facts.layer_bytes + facts.layer_bytes // 2)
    mine = without_manifest(model, tmp_path / "volunteer" / "my-copy")
    hub_repo = without_manifest(model, tmp_path / "hub" / MODEL)
    memory = ["--max-memory", two_layers]

    def assigned(nodes: list[LocalNode]) -> Callable[[Views], bool]:
        return lambda views: {n.node_id for n in nodes} <= set(spans(views.get("founder")))

    # One volunteer after another: each joins once the last one's span is
    # committed, as the suggestion it takes is the gap its ledger shows.
    founder = swarm.new_node("founder", args=memory, command=["serve", str(model)])
    await swarm.start_ready(founder, timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], assigned([founder]), SERVE_TIMEOUT_S, "one span")
    # A volunteer with a copy of the files: the swarm's manifest, the next gap.
    local = swarm.new_node("local", args=memory, command=["serve", str(mine)])
    await swarm.start_ready(local, [founder.seed], timeout=START_TIMEOUT_S)
    await wait_for(swarm, [founder], assigned([founder, local]), SERVE_TIMEOUT_S, "two spans")

    with FakeHub({REPO: hub_repo}) as hub:
        # A volunteer with nothing but the hub: only its layers' files.
        fetched = tmp_path / "volunteer" / "from-hub"
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
        remote = swarm.new_node(
            "remote",
            args=[*memory, "--model", f"hf:{REPO}"],
            env=env,
            command=["serve", str(fetched)],
        )
        await swarm.start_ready(remote, [founder.seed], timeout=START_TIMEOUT_S)
        everyone = [founder, local, remote]
        await wait_for(swarm, [founder], served(founder, everyone), SERVE_TIMEOUT_S, "served")
        shard = "model-{:05d}-of-00006.safetensors".format
        metadata = {"config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE}
        assert hub.fetched() == metadata | {shard(5), shard(6)}

    assert spans(await swarm.status(founder)) == {
        founder.node_id: ([0, 2], "bootstrap"),
        local.node_id: ([2, 4], "bootstrap"),
        remote.node_id: ([4, 6], "bootstrap"),
    }
    text, route = await trio.to_thread.run_sync(chat, remote.api)
    assert text and route == [n.node_id for n in everyone]

    # Both took the founder's manifest (its digest, its goldens' bytes) and
    # neither built one.
    digest = manifest_digest(load_manifest(model))
    golden = hashlib.sha256((model / GOLDEN_FILE).read_bytes()).hexdigest()
    for node, folder in [(local, mine), (remote, fetched)]:
        assert manifest_digest(load_manifest(folder)) == digest
        assert hashlib.sha256((folder / GOLDEN_FILE).read_bytes()).hexdigest() == golden
        log = await logged(node, f"serving {MODEL} layers ")
        assert f"manifest of {MODEL} fetched from node {founder.node_id[:12]}" in log
        assert "manifest build" not in log
    await logged(local, f"serving {MODEL} layers 2:4 of 6 (fp32); chat at {local.api}/v1")
    assert not (fetched / shard(1)).exists()
    async with httpx.AsyncClient(timeout=10) as client:
        models = (await client.get(local.api + "/v1/models")).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    await assert_no_internal_errors(swarm, everyone)


async def test_a_node_that_no_layer_fits_stops_saying_why(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / MODEL, layers=2)
    command = [sys.executable, "-m", "runtime.cli", "serve", str(folder)]
    with trio.fail_after(EXIT_TIMEOUT_S):
        result = await trio.run_process(
            [
                *command,
                "--max-memory",
                "1M",
                "--profile",
                "local",
                "--state-dir",
                str(tmp_path / "s"),
            ],
            capture_stderr=True,
            stdout=subprocess.DEVNULL,
            check=False,
        )
    assert result.returncode == 1
    last = result.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(f"shardmesh serve: error: no gap of {MODEL} fits this node: ")
    assert "this node offers 1.0 MiB (its free memory, or --max-memory)" in last
