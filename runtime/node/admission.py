"""Node capability admission: the doctor gates serving, and keeps gating it.

A shard, whoever asked for it (the operator's pin, or a managed or bootstrap
assignment), serves nothing until `runtime.model.doctor` has run the real
forward of its exact shard and recipe against the manifest's golden
activations (ADR-0026); only then is that very shard handed to a `HopServer`
and the node's record given an admitted capability report. A cheap re-check
refreshes the report while it serves; a failed one drops the node from the
coverage at once. `ShardSlot` is the node's one shard, whoever starts it.

The steps, the re-checks and what a failed doctor publishes:
docs/design/node.md#admission-the-doctor-gates-serving.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from mesh import records
from mesh.fields import one_of
from mesh.transport import Plane
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import DEFAULT_MAX_SESSIONS, HopServer
from runtime.inference.kv_memory import KvMemory, kv_bytes_per_position, kv_capacity
from runtime.model.backends import backend_available, default_backend
from runtime.model.backends.base import ShardBackend
from runtime.model.doctor import DoctorReport, admit, default_device, free_memory_bytes, recheck
from runtime.model.progress import Progress
from runtime.model.recipes import get_recipe

log = logging.getLogger("shardmesh.admission")

DEFAULT_TTL_S: Final = 600.0
"""How long a capability report stays valid. Ten minutes bounds how long a
node whose hardware went bad (and whose re-checks therefore stopped or
failed) can stay routable by a stale report, while a refresh is one probe
forward: negligible next to ten minutes of serving."""
REFRESH_FRACTION: Final = 0.5
"""Refresh at half the TTL: one missed refresh (a busy moment, a slow
gossip round) still leaves half a TTL before peers stop routing here."""
DEFAULT_RECIPE: Final = "fp32"
"""An operator's pinned shard (`--model`) without `--recipe`: the one recipe
every backend runs on every device, and the one the goldens are computed in."""
OPERATOR_EPOCH: Final = 1
"""An operator's pinned assignment is fixed for the life of the process, so
its record carries one epoch; managed and bootstrap assignments carry the
epoch the ledger committed them at."""


@dataclass(frozen=True)
class ServeOptions:
    """What `shardmesh node --model DIR --layers A:B --recipe R` asked for."""

    model_dir: Path
    layers: tuple[int, int]
    recipe: str = DEFAULT_RECIPE
    backend: str | None = None
    ttl_s: float = DEFAULT_TTL_S
    refresh_s: float | None = None  # default: ttl_s * REFRESH_FRACTION
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_memory: int | None = None
    """`--max-memory`: weights and KV caches together (None: the device's
    free memory bounds the caches once the weights are in)."""

    def __post_init__(self) -> None:
        a, b = self.layers
        if not 0 <= a < b:
            raise ValueError(f"--layers {a}:{b} must satisfy 0 <= A < B")
        if self.ttl_s <= 0 or (self.refresh_s is not None and self.refresh_s <= 0):
            raise ValueError("the capability TTL and refresh interval must be positive")

    @property
    def refresh_interval(self) -> float:
        return self.refresh_s if self.refresh_s is not None else self.ttl_s * REFRESH_FRACTION


class Admission:
    """Runs the doctor for one shard of this node and keeps its report fresh."""

    def __init__(
        self,
        options: ServeOptions,
        *,
        engine: Engine,
        plane: Plane,
        drops: Counter[str],
        publish: Callable[[], None],
        tier: str = "operator",
        epoch: int = OPERATOR_EPOCH,
    ) -> None:
        """`publish` re-signs and gossips the node's record; it is called
        whenever the assignment or capability below changes. `tier` and
        `epoch` are the assignment's: an operator's pinned shard, or a
        managed one the placement leader committed at `epoch`."""
        self.options = options
        self.tier = tier
        self.epoch = epoch
        self._engine = engine
        self._plane = plane
        self._drops = drops
        self._publish = publish
        self.state = "checking"
        self.report: DoctorReport | None = None
        self.capability: records.CapabilityReport | None = None
        self.backend_info: records.BackendInfo | None = None
        self.hop_server: HopServer | None = None

    @property
    def model_name(self) -> str | None:
        return self.report.model if self.report else None

    @property
    def manifest_digest(self) -> str | None:
        return self.report.manifest_digest if self.report else None

    def assignment(self) -> records.Assignment | None:
        """The assignment being served, once the manifest names the model."""
        if self.model_name is None:
            return None
        return records.Assignment(
            model=self.model_name,
            layers=self.options.layers,
            recipe=one_of(self.options.recipe, "recipe", records.RECIPES),
            tier=one_of(self.tier, "tier", records.TIERS),
            managed=self.tier == "managed",
            epoch=self.epoch,
        )

    async def run(self) -> None:
        """Admit, serve and refresh until cancelled."""
        o = self.options
        log.info("doctor: checking %s layers %d:%d (%s)", o.model_dir, *o.layers, o.recipe)
        progress = Progress("doctor", emit=log.info)  # a log line per phase
        report, shard = await trio.to_thread.run_sync(
            admit, o.model_dir, o.layers[0], o.layers[1], o.recipe, o.backend, progress
        )
        progress.close()
        if shard is None:
            self._record(report)
            log.error("doctor refused the shard: %s (%s)", report.reason, report.message)
            return
        # Serve first, then advertise: a peer that routes here on the new
        # record must find the hop server already attached.
        self.backend_info = _backend_info(shard)
        self.hop_server = HopServer(
            self._plane,
            shard,
            model=report.model or o.model_dir.name,
            drops=self._drops,
            signer=self._engine.signer,
            max_sessions=o.max_sessions,
            tokenizer_dir=o.model_dir,  # structured output's grammar reads the vocabulary
            kv_memory=kv_memory_of(o, shard, self.backend_info),
        )
        await self._engine.attach(self.hop_server)
        self._record(report)
        log.info(
            "admitted %s layers %d:%d (%s on %s): prefill %.0f tok/s, decode %.0f tok/s",
            report.model,
            *o.layers,
            o.recipe,
            report.device,
            report.prefill_tok_s or 0.0,
            report.decode_tok_s or 0.0,
        )
        while True:
            await trio.sleep(o.refresh_interval)
            await self.refresh(shard)

    async def refresh(self, shard: ShardBackend) -> None:
        """The cheap re-check on the held shard; republish what it found."""
        assert self.hop_server is not None and self.report is not None
        o = self.options
        fresh = await self.hop_server.on_shard(
            lambda: recheck(o.model_dir, o.layers[0], o.layers[1], o.recipe, shard=shard)
        )
        if not fresh.admitted:
            log.error("re-check failed: %s (%s); no longer serving", fresh.reason, fresh.message)
        # Throughput is not re-measured by the cheap check: keep the doctor's.
        fresh.prefill_tok_s = fresh.prefill_tok_s or self.report.prefill_tok_s
        fresh.decode_tok_s = fresh.decode_tok_s or self.report.decode_tok_s
        self._record(fresh)

    def _record(self, report: DoctorReport) -> None:
        self.report = report
        self.state = "admitted" if report.admitted else "failed"
        self.capability = _capability(report, self.options)
        self._publish()

    def to_json(self) -> dict[str, Any]:
        """The `admission` field of `/v1/network/status`."""
        report = self.report
        return {
            "state": self.state,
            "model_dir": str(self.options.model_dir),
            "layers": list(self.options.layers),
            "recipe": self.options.recipe,
            "ttl_s": self.options.ttl_s,
            "refresh_s": self.options.refresh_interval,
            "doctor": None if report is None else report.to_dict(),
        }


def _capability(report: DoctorReport, options: ServeOptions) -> records.CapabilityReport | None:
    """The signed-record form of a doctor report (None when the doctor did
    not get far enough to know which model it was looking at)."""
    if report.manifest_digest is None or report.model is None or report.backend is None:
        return None
    now = time.time()
    return records.CapabilityReport(
        result="admitted" if report.admitted else "failed",
        model=report.model,
        manifest_digest=report.manifest_digest,
        layers=options.layers,
        recipe=options.recipe,  # type: ignore[arg-type]
        backend=report.backend,  # type: ignore[arg-type]
        prefill_tokens_per_s=float(report.prefill_tok_s or 0.0),
        decode_tokens_per_s=float(report.decode_tok_s or 0.0),
        validated_at=now,
        expires_at=now + options.ttl_s,
        num_layers=report.num_layers,
        failure=None
        if report.admitted
        else f"{report.failed_check}: {report.reason}: {report.message}"[
            : records.MAX_FAILURE_CHARS
        ],
    )


def kv_memory_of(
    o: ServeOptions, shard: ShardBackend, info: records.BackendInfo
) -> KvMemory | None:
    """The hop's cache budget: `--max-memory` beside the weights, at most
    the device's free memory after they loaded (`runtime.inference.kv_memory`);
    None (and a warning) for a config that does not say its heads."""
    try:
        config = json.loads((o.model_dir / "config.json").read_text())
        layers = o.layers[1] - o.layers[0]
        per_position = kv_bytes_per_position(config, layers, get_recipe(o.recipe).dtype)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning(
            "no KV budget for %s (%s): sessions are bounded by count alone", o.model_dir, exc
        )
        return None
    weights = int(shard.info().get("weight_bytes") or 0)
    capacity = kv_capacity(o.max_memory, weights, info.memory_bytes or None)
    return KvMemory(capacity, per_position)


def _backend_info(shard: ShardBackend) -> records.BackendInfo:
    free, _source = free_memory_bytes(shard.device)
    return records.BackendInfo(
        kind=shard.name,  # type: ignore[arg-type]
        device=shard.device,
        memory_bytes=int(free or 0),
    )


def probe_backend(backend: str | None, max_memory: int | None = None) -> records.BackendInfo | None:
    """What a node without a shard offers: its backend, device and free
    memory (at most `max_memory`, the operator's `--max-memory`), which the
    placement leader sizes managed shards by. None when the backend is not
    installed (the node then offers no capacity). Slow (imports the
    backend): call it in a worker thread."""
    name = backend or default_backend()
    if not backend_available(name):
        return None
    try:
        device = default_device(name)
    except ImportError:
        return None
    free, _source = free_memory_bytes(device)
    memory = int(free or 0)
    if max_memory is not None:  # free memory unknown: the operator's figure is all there is
        memory = max_memory if free is None else min(memory, max_memory)
    return records.BackendInfo(kind=name, device=device, memory_bytes=memory)  # type: ignore[arg-type]


class ShardSlot:
    """The one shard this node serves (one assignment per node, ADR-0026).

    Whoever starts a shard goes through the slot: the daemon for the
    operator's pin, the placement driver for a managed or bootstrap
    assignment. The record and the status read the current admission from
    it, so no component reaches into another to swap what is served.
    """

    def __init__(
        self, *, engine: Engine, plane: Plane, drops: Counter[str], publish: Callable[[], None]
    ) -> None:
        """`publish` re-signs and gossips the node's record."""
        self._engine = engine
        self._plane = plane
        self._drops = drops
        self._publish = publish
        self._admission: Admission | None = None
        self._offered: records.BackendInfo | None = None

    @property
    def admission(self) -> Admission | None:
        return self._admission

    @property
    def backend(self) -> records.BackendInfo | None:
        """The backend the record advertises: the serving shard's, else the
        capacity a model-less node offers (None until probed)."""
        return self._admission.backend_info if self._admission else self._offered

    async def offer_capacity(
        self, backend: str | None, max_memory: int | None = None
    ) -> records.BackendInfo | None:
        """Find out (in a thread: it imports the backend) what this
        model-less node can offer placement, at most `max_memory` bytes,
        then advertise it; what it offers (None: no backend)."""
        self._offered = await trio.to_thread.run_sync(probe_backend, backend, max_memory)
        if self._offered is None:
            log.warning("backend %s is not installed: offering no capacity", backend)
        self._publish()
        return self._offered

    def start(
        self, options: ServeOptions, *, tier: str = "operator", epoch: int = OPERATOR_EPOCH
    ) -> Admission:
        """An admission for `options` in the slot; the caller runs it."""
        self._admission = Admission(
            options,
            engine=self._engine,
            plane=self._plane,
            drops=self._drops,
            publish=self._publish,
            tier=tier,
            epoch=epoch,
        )
        return self._admission

    def clear(self) -> None:
        """Stop serving (after the admission's task was cancelled): detach
        the hop server from the engine and publish a record without it."""
        self._engine.detach()
        self._admission = None
        self._publish()
