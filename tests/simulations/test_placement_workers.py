"""The workers of a placement simulation: their specs, the cost model's
load and doctor times, following the ledger, and the record they gossip."""

from __future__ import annotations

import pytest

from consensus.commands import Assign, Release, encode_command
from consensus.ledger import PlacementLedger
from consensus.placement import ModelFacts
from mesh.records import Assignment
from simulations.loop import EventLoop
from simulations.placement_trace import Trace
from simulations.placement_workers import (
    DECODE_LAYERS_PER_S,
    DOCTOR_S,
    GB,
    LOAD_BYTES_PER_S,
    Fleet,
    Lies,
    WorkerSpec,
    worker_node,
)

MODELS = {"y": ModelFacts(32, GB // 2)}
"""32 layers of half a GB: 16 GB for a whole copy."""


def fleet(*specs: WorkerSpec) -> tuple[Fleet, Trace]:
    trace = Trace(EventLoop(), keep=True)
    return Fleet(specs, MODELS, trace), trace


def assign(ledger: PlacementLedger, index: int, node: bytes, layers: tuple[int, int]) -> None:
    command = Assign(node, "y", layers, "bf16", "managed", True, index, 0.0)
    assert ledger.apply(index, encode_command(command)).accepted


def test_specs_refuse_impossible_values() -> None:
    with pytest.raises(ValueError, match="rate"):
        Lies(0.0)
    with pytest.raises(ValueError, match="rate"):
        Lies(1.5)
    with pytest.raises(ValueError, match="from_s"):
        Lies(0.5, from_s=-1.0)
    with pytest.raises(ValueError, match="hardware"):
        WorkerSpec(24, hardware="tpu")
    with pytest.raises(ValueError, match="memory_gb"):
        WorkerSpec(0)


def test_worker_node_ids_are_distinct_32_byte_ids() -> None:
    ids = [worker_node(i) for i in range(300)]
    assert len(set(ids)) == 300 and all(len(node) == 32 for node in ids)
    assert ids[0][0] == 0xAA


@pytest.mark.parametrize("hardware", sorted(LOAD_BYTES_PER_S))
def test_a_load_takes_its_bytes_at_the_hardware_speed_then_the_doctor(hardware: str) -> None:
    workers, trace = fleet(WorkerSpec(24, ("y",), hardware=hardware))
    worker = workers.workers[0]
    workers.load(worker, Assignment("y", (0, 16), "bf16", "managed", True, 1), now=10.0)
    assert worker.serving is not None and worker.verdict == "none"
    assert worker.ready_at == pytest.approx(10.0 + 8 * GB / LOAD_BYTES_PER_S[hardware] + DOCTOR_S)
    assert trace.lines == ["0.000000 load 0 y (0, 16)"]


def test_the_doctor_admits_or_fails_once_the_load_is_done() -> None:
    failing = WorkerSpec(24, ("y",), pinned="y", fails_doctor=True)
    workers, _ = fleet(WorkerSpec(24, ("y",), pinned="y"), failing)
    workers.load_pinned(now=0.0)
    ready = workers.workers[0].ready_at
    workers.follow(PlacementLedger(), now=ready - 0.1)
    assert [w.verdict for w in workers.workers] == ["none", "none"]
    workers.follow(PlacementLedger(), now=ready)
    assert [w.verdict for w in workers.workers] == ["admitted", "failed"]
    assert workers.workers[0].serving == workers.pin("y")  # a pinned worker keeps its pin


def test_a_spare_worker_serves_what_the_ledger_assigns_and_unloads_when_released() -> None:
    workers, trace = fleet(WorkerSpec(24, ("y",)))
    worker = workers.workers[0]
    ledger = PlacementLedger()
    workers.follow(ledger, now=0.0)
    assert worker.serving is None
    assign(ledger, 1, worker.node, (0, 32))
    workers.follow(ledger, now=1.0)
    assert worker.serving == Assignment("y", (0, 32), "bf16", "managed", True, 1)
    first_ready = worker.ready_at
    workers.follow(ledger, now=2.0)  # the same assignment: no reload
    assert worker.ready_at == first_ready
    assert ledger.apply(2, encode_command(Release(worker.node, "y", 1, "idle", 3.0))).accepted
    workers.follow(ledger, now=3.0)
    assert worker.serving is None and worker.verdict == "none"
    assert trace.lines is not None and trace.lines[-1].endswith("unload 0")


def test_a_crash_drops_the_shard_and_a_restart_reloads_only_a_pin() -> None:
    workers, _ = fleet(WorkerSpec(24, ("y",), pinned="y"), WorkerSpec(24, ("y",)))
    workers.load_pinned(now=0.0)
    workers.workers[1].serving = Assignment("y", (0, 32), "bf16", "managed", True, 1)
    for index in (0, 1):
        workers.crash(index, now=5.0)
        assert not workers.workers[index].alive and workers.workers[index].serving is None
        workers.restart(index, now=9.0)
        assert workers.workers[index].alive and workers.workers[index].since == 9.0
    assert workers.workers[0].serving == workers.pin("y")
    assert workers.workers[1].serving is None


def test_the_record_claims_the_hardware_decode_rate_for_the_span_once_examined() -> None:
    workers, _ = fleet(WorkerSpec(24, ("y",), hardware="mac"), WorkerSpec(24, ("y",)))
    mac, gpu = workers.workers
    shard = Assignment("y", (0, 16), "bf16", "managed", True, 1)
    workers.load(mac, shard, now=0.0)
    assert workers.record(mac).capability is None  # still loading
    mac.verdict = "admitted"
    capability = workers.record(mac).capability
    assert capability is not None and capability.result == "admitted"
    assert capability.backend == "mlx" and capability.layers == (0, 16)
    assert capability.decode_tokens_per_s == DECODE_LAYERS_PER_S["mac"] / 16
    assert workers.record(mac).addresses.control == "sim:worker-0"
    workers.load(gpu, shard, now=0.0)
    gpu.verdict = "failed"
    failed = workers.record(gpu).capability
    assert failed is not None and failed.result == "failed" and failed.failure == "doctor failed"
