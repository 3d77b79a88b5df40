"""The workers of a placement simulation and the cost model they run on.

A worker is a node that may serve a shard: its memory, store, hardware
class, operator pin, and whether it fails its doctor or lies. `Fleet`
holds them and plays their side of the protocol: loading what the ledger
assigns at its hardware class's speed, running the doctor, and gossiping
the record entries route by. The figures (load speeds, doctor time,
decode rates) are the cost model's only knobs; docs/design/placement-simulation.md
says where each comes from.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from consensus.ledger import PlacementLedger
from consensus.placement import CapabilityState, ModelFacts
from mesh.fields import one_of
from mesh.records import (
    RECIPES,
    TIERS,
    Addresses,
    Assignment,
    BackendKind,
    CapabilityReport,
    NodeRecord,
)
from simulations.placement_trace import Trace

__all__ = [
    "BACKENDS",
    "DECODE_LAYERS_PER_S",
    "DOCTOR_S",
    "FOLLOW_S",
    "GB",
    "LOAD_BYTES_PER_S",
    "REPORT_EXPIRES_AT",
    "Fleet",
    "Lies",
    "Worker",
    "WorkerSpec",
    "worker_node",
]

GB: Final = 1 << 30
FOLLOW_S: Final = 0.2
"""How often a worker compares the ledger's assignment with what it serves."""
DOCTOR_S: Final = 5.0
"""A doctor run: a real forward pass and a throughput measurement."""
LOAD_BYTES_PER_S: Final[Mapping[str, float]] = {
    "gpu": 2.0 * GB,  # NVMe into a GPU box's host memory, then to the device
    "mac": 1.5 * GB,  # Apple SSD into unified memory
    "cpu": 0.5 * GB,  # a volunteer's SATA disk
}
"""Shard load speed per hardware class, the cost model's one knob per class."""
DECODE_LAYERS_PER_S: Final[Mapping[str, float]] = {
    "gpu": 32 * 40.0,  # a 7-8B model's 32 layers at ~40 tokens/s on a consumer GPU
    "mac": 32 * 20.0,  # ~20 tokens/s on Apple silicon
    "cpu": 32 * 4.0,  # ~4 tokens/s on a volunteer's CPU
}
"""Decode steps times layers per second, per hardware class: a doctor's
claim for a span is this over its layer count (`decode_tokens_per_s`),
which routes price a hop by."""
BACKENDS: Final[Mapping[str, BackendKind]] = {"gpu": "torch", "mac": "mlx", "cpu": "torch"}
"""The backend a hardware class's doctor reports."""
REPORT_EXPIRES_AT: Final = sys.float_info.max
"""A node refreshes its capability report before it expires
(`runtime.node.admission`); the refresh is not simulated, so a simulated
report never expires."""


@dataclass(frozen=True, slots=True)
class Lies:
    """A worker that returns wrong outputs (a faulty card, a tampered build,
    a cheat saving compute): on each decode step it runs from `from_s` on,
    with probability `rate`."""

    rate: float
    from_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.rate <= 1:
            raise ValueError(f"a liar's rate must be in (0, 1], not {self.rate!r}")
        if not 0 <= self.from_s < math.inf:
            raise ValueError(f"a liar's from_s must be a time >= 0, not {self.from_s!r}")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A node that may serve: its memory, store, hardware, operator pin, and
    whether it lies."""

    memory_gb: float
    models: tuple[str, ...] = ()
    pinned: str | None = None
    """An operator pinned it to the whole of this model (`--model`)."""
    hardware: str = "gpu"
    fails_doctor: bool = False
    lies: Lies | None = None

    def __post_init__(self) -> None:
        if self.hardware not in LOAD_BYTES_PER_S:
            raise ValueError(f"hardware must be one of {', '.join(LOAD_BYTES_PER_S)}")
        if self.memory_gb <= 0:
            raise ValueError("memory_gb must be positive")


@dataclass
class Worker:
    """One worker as it runs: up or down since when, and what it serves."""

    spec: WorkerSpec
    node: bytes
    alive: bool = True
    since: float = 0.0
    serving: Assignment | None = None
    ready_at: float = math.inf
    verdict: CapabilityState = "none"
    """Its doctor's verdict on `serving`: none (loading), admitted, failed."""
    gossiped: NodeRecord | None = None
    """SWIM, while it is crashed: the record it gossiped last, which members
    keep (and entries route by) until their own core holds it dead."""


def worker_node(index: int) -> bytes:
    """Worker `index`'s node id: 0xAA, then the index, 32 bytes in all."""
    return bytes([0xAA, *index.to_bytes(31, "big")])


class Fleet:
    """The workers, playing their side: load, doctor, follow the ledger, gossip."""

    def __init__(
        self, specs: Sequence[WorkerSpec], models: Mapping[str, ModelFacts], trace: Trace
    ) -> None:
        self.workers = [Worker(spec, worker_node(i)) for i, spec in enumerate(specs)]
        self.index = {w.node: i for i, w in enumerate(self.workers)}
        """Node id -> the worker's number."""
        self._models = models
        self._trace = trace
        self._digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in models}

    def load_pinned(self, now: float) -> None:
        """Every pinned worker starts loading its whole model (at boot)."""
        for worker in self.workers:
            if worker.spec.pinned is not None:
                self.load(worker, self.pin(worker.spec.pinned), now)

    def pin(self, model: str) -> Assignment:
        """The operator's assignment: every layer of `model`, pinned."""
        layers = (0, self._models[model].num_layers)
        recipe = one_of(self._models[model].recipe, "recipe", RECIPES)  # ModelFacts checked it
        return Assignment(model, layers, recipe, "operator", False, 0)

    def load(self, worker: Worker, assignment: Assignment, now: float) -> None:
        """Start loading `assignment`: ready after the load and the doctor."""
        facts = self._models[assignment.model]
        size = (assignment.layers[1] - assignment.layers[0]) * facts.layer_bytes
        worker.serving = assignment
        worker.verdict = "none"
        worker.ready_at = now + size / LOAD_BYTES_PER_S[worker.spec.hardware] + DOCTOR_S
        self._trace.note(f"load {self.index[worker.node]} {assignment.model} {assignment.layers}")

    def follow(self, ledger: PlacementLedger, now: float) -> None:
        """Each live worker's round: finish its doctor when its load is done,
        then serve what `ledger` assigns it (a pinned one keeps its pin)."""
        for worker in self.workers:
            if not worker.alive:
                continue
            if worker.serving is not None and worker.verdict == "none" and now >= worker.ready_at:
                worker.verdict = "failed" if worker.spec.fails_doctor else "admitted"
                self._trace.note(f"doctor {self.index[worker.node]} {worker.verdict}")
            if worker.spec.pinned is None:
                self._follow_ledger(worker, ledger, now)

    def _follow_ledger(self, worker: Worker, ledger: PlacementLedger, now: float) -> None:
        held = ledger.assignment(worker.node)
        if held is None or held.tier == "operator":
            if worker.serving is not None:
                worker.serving, worker.verdict = None, "none"
                self._trace.note(f"unload {self.index[worker.node]}")
            return
        serving = worker.serving
        shard = (held.model, held.layers, held.recipe, held.tier, held.managed, held.epoch)
        if serving is not None and shard == (
            serving.model,
            serving.layers,
            serving.recipe,
            serving.tier,
            serving.managed,
            serving.epoch,
        ):
            return  # field by field: an Assignment built every round cost a fifth of a run
        # The ledger checked recipe and tier; one_of narrows their types.
        wanted = Assignment(
            held.model,
            held.layers,
            one_of(held.recipe, "recipe", RECIPES),
            one_of(held.tier, "tier", TIERS),
            held.managed,
            held.epoch,
        )
        self.load(worker, wanted, now)

    def crash(self, index: int, now: float) -> None:
        """Worker `index` goes down, and with it whatever it served."""
        worker = self.workers[index]
        worker.alive, worker.since = False, now
        worker.serving, worker.verdict = None, "none"
        self._trace.note(f"crash {index}")

    def restart(self, index: int, now: float) -> None:
        """Worker `index` comes back empty; a pinned one reloads its pin."""
        worker = self.workers[index]
        worker.alive, worker.since, worker.gossiped = True, now, None
        if worker.spec.pinned is not None:
            self.load(worker, self.pin(worker.spec.pinned), now)
        self._trace.note(f"restart {index}")

    def record(self, worker: Worker) -> NodeRecord:
        """The record a worker gossips: its shard and its doctor's report,
        claiming its hardware class's decode rate for the span."""
        index = self.index[worker.node]
        shard = worker.serving
        capability = None
        if shard is not None and worker.verdict != "none":
            admitted = worker.verdict == "admitted"
            hardware = worker.spec.hardware
            layers = shard.layers[1] - shard.layers[0]
            capability = CapabilityReport(
                result="admitted" if admitted else "failed",
                model=shard.model,
                manifest_digest=self._digests[shard.model],
                layers=shard.layers,
                recipe=shard.recipe,
                backend=BACKENDS[hardware],
                prefill_tokens_per_s=0.0,  # routes price decode steps only
                decode_tokens_per_s=DECODE_LAYERS_PER_S[hardware] / layers,
                validated_at=worker.ready_at,
                expires_at=REPORT_EXPIRES_AT,
                failure=None if admitted else "doctor failed",
                num_layers=self._models[shard.model].num_layers,
            )
        address = f"sim:worker-{index}"
        return NodeRecord(
            Addresses(address, address), worker.since, assignment=shard, capability=capability
        )
