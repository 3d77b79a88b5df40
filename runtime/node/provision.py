"""`shardmesh serve`: a model folder made servable, and this node offered for it.

A volunteer names a model folder (or a hub repository) and nothing else; the
node does what an operator would otherwise do by hand: the manifest (the
folder's, a member's that describes these files, or built here), the store,
the capacity offered, the span (by `--auto-join`, the gap the swarm lacks),
and one line saying what is served. `Provisioner` runs these steps.

Each step in full: docs/design/node.md#provisioning-shardmesh-serve.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import httpx
import trio

from mesh.identity import node_id_text
from mesh.member_table import LIVE_STATES
from mesh.records import BackendInfo
from runtime.model.backends import IMPORT_LOCK, default_backend
from runtime.model.backends.base import BackendError
from runtime.model.hub import HubModel
from runtime.model.manifest import (
    GOLDEN_FILE,
    MANIFEST_FILE,
    ManifestError,
    build_manifest,
    file_sha256,
    has_chat_template,
    install_manifest,
    load_manifest,
    manifest_digest,
    tensor_table,
)
from runtime.model.peer_manifest import manifest_mismatch
from runtime.model.progress import Progress
from runtime.model.store import ModelStore, StoredModel, model_facts
from runtime.model.weights import CONFIG_FILE, SafetensorsReader
from runtime.node.admission import ShardSlot
from runtime.node.options import NodeStartupError, Provision
from runtime.node.placement_driver import Placement
from runtime.node.swarm_view import SwarmView

log = logging.getLogger("shardmesh.serve")

POLL_S: Final = 0.2
"""How often the steps that wait on the swarm look again (a join, a
seed's record, the admission): a tenth of a human's patience, and a few
dictionary reads each time."""
SEED_RECORD_WAIT_S: Final = 10.0
"""After the join, how long to wait for a seed's signed record (it comes
with the join's state exchange, well within a second on any profile)
before giving up on the members' manifests and building one here."""
FETCH_TIMEOUT_S: Final = 120.0
"""One manifest or golden file from a member: the goldens of an 80-layer
model are tens of MB, a minute on a slow volunteer's uplink."""
NO_TEMPLATE_NOTE: Final = "no chat template: text completions only (/v1/completions)"
"""What the serving line says instead of "chat" for a model without a chat template."""
NO_GAP_GRACE_S: Final = 3.0
"""The swarm must show no gap for this long before the node says it stays
spare: a gap it is about to take can look taken for a placement round."""


class Provisioner:
    """Runs the steps of the module doc for one node (`run`, in its nursery)."""

    def __init__(
        self,
        wanted: Provision,
        *,
        swarm: SwarmView,
        joined: Callable[[], bool],
        seeds: Sequence[bytes],
        store: ModelStore,
        slot: ShardSlot,
        placement: Placement,
        assigned: Callable[[], bool],
        republish: Callable[[], None],
        api: Callable[[], str],
        backend: str | None,
        max_memory: int | None,
    ) -> None:
        """`joined`: whether a seed answered; `assigned`: whether the ledger
        holds an assignment for this node; `api`: this node's API URL."""
        self.wanted = wanted
        self._swarm = swarm
        self._joined = joined
        self._seeds = list(seeds)
        self._store = store
        self._slot = slot
        self._placement = placement
        self._assigned = assigned
        self._republish = republish
        self._api = api
        self._backend = backend
        self._max_memory = max_memory
        self._hub = (
            None
            if wanted.hub is None
            else HubModel(wanted.hub, wanted.model_dir, progress=_progress("hub"))
        )
        self._table: dict[str, Any] | None = None

    async def run(self) -> None:
        """Stock the store, offer capacity, say what is served. Raises
        NodeStartupError when the model cannot be served here at all."""
        try:
            stored = await self._stock()
        except (BackendError, OSError) as exc:  # the folder's files, or the hub's
            raise NodeStartupError(f"cannot serve {self.wanted.model_dir}: {exc}") from None
        self._republish()
        offered = await self._slot.offer_capacity(self._backend, self._max_memory)
        if not self._assigned():  # a restart serves its span again, whatever is free
            self._check_fits(stored, offered)
        await self._announce(stored, offered)

    # --- 1 and 2: the manifest and the store -----------------------------------------

    async def _stock(self) -> StoredModel:
        folder = self.wanted.model_dir
        names = await trio.to_thread.run_sync(self._tensor_names)
        if (folder / MANIFEST_FILE).is_file():
            try:
                why = manifest_mismatch(load_manifest(folder), folder, names)
            except ManifestError as exc:
                why = str(exc)
            if why is None:
                return self._add()
            log.warning("%s no longer describes this folder (%s): replacing it", MANIFEST_FILE, why)
        if not (self._seeds and await self._adopt(names)):
            await self._build()
        return self._add()

    def _add(self) -> StoredModel:
        try:
            stored = self._store.add(self.wanted.model_dir, source=self._hub)
        except ManifestError as exc:
            raise NodeStartupError(str(exc)) from None
        log.info("model %s (digest %s) is in this node's store", stored.name, stored.digest[:16])
        return stored

    def _tensor_names(self) -> list[str]:
        """The checkpoint's tensors: the hub's index, else the files' headers."""
        if self._hub is not None:
            return self._hub.tensor_names()
        return SafetensorsReader(self.wanted.model_dir).names()

    async def _adopt(self, names: list[str]) -> bool:
        """Take a member's manifest of this model (module doc, step 1);
        whether one was installed."""
        await self._wait_for_seed()
        config_sha = await trio.to_thread.run_sync(file_sha256, self.wanted.model_dir / CONFIG_FILE)
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as client:
            for name, sources in sorted(self._stored_by_members().items()):
                for node, api in sources:
                    path = f"/v1/network/models/{quote(name, safe='')}/manifest"
                    manifest = await _get_json(client, api + path)
                    if manifest is None:
                        continue  # this member did not answer: ask the next
                    if manifest.get("config_sha256") != config_sha:
                        if _digest_or_none(manifest) in self._attested(name):
                            break  # the swarm's copy of another model: skip its other members
                        continue
                    why = await self._refusal(manifest, name, names)
                    why = why or await self._install(client, api, manifest)
                    if why is None:
                        log.info(
                            "manifest of %s fetched from node %s and verified against this "
                            "folder's files (digest %s): no golden pass needed",
                            name,
                            node_id_text(node)[:12],
                            manifest_digest(manifest)[:16],
                        )
                        return True
                    log.warning(
                        "refused the manifest of %s from node %s: %s",
                        name,
                        node_id_text(node)[:12],
                        why,
                    )
        return False

    async def _refusal(self, manifest: dict[str, Any], name: str, names: list[str]) -> str | None:
        """Why a member's manifest of `name` cannot be this folder's, or None."""
        folder = self.wanted.model_dir
        why = await trio.to_thread.run_sync(manifest_mismatch, manifest, folder, names)
        if why is None and self._hub is None:  # the weights are here: check every digest
            if self._table is None:
                self._table = await trio.to_thread.run_sync(_hash_tensors, folder)
            why = await trio.to_thread.run_sync(manifest_mismatch, manifest, folder, self._table)
        if why is not None:
            return why
        if manifest["name"] != name:
            return f"asked for {name!r}, it sent {manifest['name']!r}"
        digest = _digest_or_none(manifest)
        if digest is None:
            return "its golden table is not an object"
        attested = self._attested(name)
        if attested and digest not in attested:
            return (
                f"its digest {digest[:16]} is not the one the nodes serving {name} sign "
                f"({', '.join(sorted(d[:16] for d in attested))})"
            )
        return None

    async def _install(
        self, client: httpx.AsyncClient, api: str, manifest: dict[str, Any]
    ) -> str | None:
        """Fetch the manifest's goldens and write both; why not, or None."""
        url = f"{api}/v1/network/artifacts/{manifest_digest(manifest)}/{GOLDEN_FILE}"
        try:
            reply = await client.get(url)
            reply.raise_for_status()
            await trio.to_thread.run_sync(
                install_manifest, self.wanted.model_dir, manifest, reply.content
            )
        except httpx.HTTPError as exc:
            return f"its golden activations could not be fetched: {exc}"
        except (ManifestError, OSError) as exc:
            return str(exc)
        return None

    async def _wait_for_seed(self) -> None:
        """Until a seed answered (the node keeps trying and logs why it
        cannot), then briefly for a seed's record, which names the API to ask."""
        while not self._joined():
            await trio.sleep(POLL_S)
        with trio.move_on_after(SEED_RECORD_WAIT_S):
            while not any(self._swarm.record(seed) for seed in self._seeds):
                await trio.sleep(POLL_S)

    def _stored_by_members(self) -> dict[str, list[tuple[bytes, str]]]:
        """Model name -> (node, API URL) of each live member that stores it."""
        found: dict[str, list[tuple[bytes, str]]] = {}
        for view, record in self._swarm.records():
            if record is None or view.node == self._swarm.node_id:
                continue
            api = record.addresses.api
            if str(view.state) in LIVE_STATES and api is not None:
                for name in record.models:
                    found.setdefault(name, []).append((view.node, api))
        return found

    def _attested(self, name: str) -> set[str]:
        """The manifest digests that members admitted for `name` sign."""
        return {
            record.capability.manifest_digest
            for view, record in self._swarm.records()
            if record is not None
            and str(view.state) in LIVE_STATES
            and record.capability is not None
            and record.capability.result == "admitted"
            and record.capability.model == name
        }

    async def _build(self) -> None:
        folder, hub = self.wanted.model_dir, self._hub
        if hub is not None:
            await trio.to_thread.run_sync(hub.fetch_all)
        name = self.wanted.name or (hub.source.name if hub is not None else None)
        if self._seeds and (name or folder.name) in self._stored_by_members():
            log.warning(
                "the swarm has a model named %s that is not this folder's (see above); "
                "this one joins as another model of that name: give it its own with --name",
                name or folder.name,
            )
        log.info("building the manifest of %s (golden activations and calibration)", folder)
        await trio.to_thread.run_sync(_build_manifest, folder, name, self._table)

    # --- 3: capacity -------------------------------------------------------------------

    def _check_fits(self, stored: StoredModel, offered: BackendInfo | None) -> None:
        if offered is None:
            raise NodeStartupError(
                f"backend {self._backend or default_backend()} is not installed: this node "
                "cannot compute a shard"
            )
        facts = model_facts(stored.manifest)
        if facts.max_layers(offered.memory_bytes) == 0:
            raise NodeStartupError(
                f"no gap of {stored.name} fits this node: one layer needs "
                f"{_mib(facts.layer_bytes)} beside {_mib(facts.overhead_bytes)} for the "
                "embeddings, LM head and runtime, "
                f"and this node offers {_mib(offered.memory_bytes)} "
                "(its free memory, or --max-memory)"
            )

    # --- 5: one line --------------------------------------------------------------------

    async def _announce(self, stored: StoredModel, offered: BackendInfo | None) -> None:
        """Say once what this node serves and where, or why it serves nothing."""
        spare_since: float | None = None
        said_spare = False
        while True:
            await trio.sleep(POLL_S)
            admission = self._slot.admission
            if admission is not None and admission.state == "admitted":
                a, b = admission.options.layers
                whole = (a, b) == (0, int(stored.manifest["num_layers"]))
                log.info(
                    "serving %s layers %d:%d%s (%s); %s at %s/v1 (OpenAI API, model %r)",
                    stored.name,
                    a,
                    b,
                    "" if whole else f" of {stored.manifest['num_layers']}",
                    admission.options.recipe,
                    "chat" if has_chat_template(stored.path) else NO_TEMPLATE_NOTE,
                    self._api(),
                    stored.name,
                )
                return
            if admission is not None and admission.state == "failed":
                log.error("not serving %s: the doctor refused its span (see above)", stored.name)
                return
            if self._assigned() or said_spare or not self._no_gap(stored, offered):
                spare_since = None
                continue
            now = trio.current_time()
            spare_since = now if spare_since is None else spare_since
            if now - spare_since >= NO_GAP_GRACE_S:
                said_spare = True
                log.info(
                    "the swarm serves every layer of %s already: this node stays spare for "
                    "it (placement adds it where demand grows or a node leaves); API at %s",
                    stored.name,
                    self._api(),
                )

    def _no_gap(self, stored: StoredModel, offered: BackendInfo | None) -> bool:
        if offered is None or self._placement.num_layers(stored.name) is None:
            return False  # placement does not know the model's size yet
        return self._placement.suggest(offered.memory_bytes, [stored.name]) is None


def _progress(task: str) -> Progress:
    """Progress of a step as log lines (`runtime.model.progress`)."""
    return Progress(task, emit=log.info)


def _hash_tensors(folder: Path) -> dict[str, Any]:
    with _progress("checking this folder's weights") as progress:
        return tensor_table(folder, progress)


def _build_manifest(folder: Path, name: str | None, tensors: dict[str, Any] | None) -> None:
    """Under the import lock: the build is the first in this process to load
    a model class through transformers' lazy module, which is not safe to
    resolve while another thread (the chat entry's tokenizer import) does."""
    with IMPORT_LOCK, _progress("manifest build") as progress:
        build_manifest(folder, name, progress, tensors)


async def _get_json(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    """The JSON object at `url`, or None (no answer, an error, not an object)."""
    try:
        reply = await client.get(url)
        reply.raise_for_status()
        document = reply.json()
    except (httpx.HTTPError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _digest_or_none(manifest: dict[str, Any]) -> str | None:
    """The digest of what may not be a manifest at all (a peer's answer)."""
    try:
        return manifest_digest(manifest)
    except (KeyError, TypeError, AttributeError):
        return None


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
