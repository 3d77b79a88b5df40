"""Admission: the doctor gates a shard, the slot serves what passed, the record follows.

A real tiny model (torch on CPU), the real doctor, a real engine on loopback.
The doctor's own checks are in tests/runtime/model/test_doctor.py.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import trio

from mesh import records
from mesh.identity import Identity
from mesh.transport import open_planes
from runtime.inference.dispatch import Engine
from runtime.inference.kv_memory import kv_bytes_per_position
from runtime.model.backends import load_shard
from runtime.model.backends.base import ShardSpec
from runtime.model.tiny import make_tiny_model
from runtime.node.admission import ServeOptions, ShardSlot, kv_memory_of, probe_backend

LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("admission") / "tiny", layers=4, name="tiny")


def test_serve_options_are_checked() -> None:
    with pytest.raises(ValueError, match="0 <= A < B"):
        ServeOptions(Path("m"), (3, 3))
    with pytest.raises(ValueError, match="must be positive"):
        ServeOptions(Path("m"), (0, 2), ttl_s=0)
    assert ServeOptions(Path("m"), (0, 2), ttl_s=100).refresh_interval == 50


def test_max_memory_leaves_the_caches_what_the_weights_do_not_take(model: Path) -> None:
    shard = load_shard(ShardSpec(model, 0, 4, "fp32"), "torch")
    weights = shard.info()["weight_bytes"]
    config = json.loads((model / "config.json").read_text())
    per_position = kv_bytes_per_position(config, 4, "float32")
    info = records.BackendInfo("torch", "cpu", 10**12)
    capped = kv_memory_of(
        ServeOptions(model, (0, 4), max_memory=weights + 100 * per_position), shard, info
    )
    assert capped is not None and capped.bytes_per_position == per_position
    assert capped.capacity_bytes == 100 * per_position
    assert kv_memory_of(ServeOptions(model, (0, 4)), shard, info).capacity_bytes == 10**12
    broken = model.parent / "no-heads"
    shutil.copytree(model, broken)
    (broken / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert kv_memory_of(ServeOptions(broken, (0, 4)), shard, info) is None, "a warning, no crash"


def test_a_model_less_node_offers_at_most_its_cap() -> None:
    offered = probe_backend("torch", max_memory=1000)
    assert offered is not None and offered.kind == "torch"
    assert 0 <= offered.memory_bytes <= 1000


async def test_an_admitted_shard_is_served_then_advertised_and_cleared(model: Path) -> None:
    identity = Identity.generate()
    published: list[int] = []
    async with (
        open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=identity.plane_keys()) as (_, data),
        trio.open_nursery() as nursery,
    ):
        engine = Engine(data, drops=Counter(), signer=identity)
        await nursery.start(engine.run)
        slot = ShardSlot(
            engine=engine, plane=data, drops=Counter(), publish=lambda: published.append(1)
        )
        admission = slot.start(ServeOptions(model, (2, 4)))
        assert slot.admission is admission and admission.state == "checking"
        nursery.start_soon(admission.run)
        with trio.fail_after(120):
            while admission.state == "checking":
                await trio.sleep(0.05)
        assert admission.state == "admitted", admission.to_json()
        assert engine.hop_server is admission.hop_server is not None, "serving before advertised"
        assignment = admission.assignment()
        assert assignment is not None and assignment.layers == (2, 4)
        assert (assignment.tier, assignment.managed) == ("operator", False)
        capability = admission.capability
        assert capability is not None and capability.result == "admitted"
        assert capability.layers == (2, 4) and capability.expires_at > capability.validated_at
        assert slot.backend is not None and slot.backend.kind == "torch"
        assert published, "the record was republished with the capability"
        kv = admission.hop_server.kv_memory
        assert kv is not None and kv.bytes_per_position > 0, "the caches are budgeted"
        nursery.cancel_scope.cancel()
    slot.clear()
    assert engine.hop_server is None and slot.admission is None


async def test_a_shard_the_doctor_refuses_is_never_served(model: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(model, tmp_path / "broken"))
    weights = next(broken.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte: a digest mismatch
    weights.write_bytes(bytes(data))
    identity = Identity.generate()
    async with (
        open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=identity.plane_keys()) as (_, plane),
        trio.open_nursery() as nursery,
    ):
        engine = Engine(plane, drops=Counter(), signer=identity)
        await nursery.start(engine.run)
        slot = ShardSlot(engine=engine, plane=plane, drops=Counter(), publish=lambda: None)
        admission = slot.start(ServeOptions(broken, (0, 4)))
        with trio.fail_after(120):
            await admission.run()  # returns: nothing to serve
        assert admission.state == "failed" and engine.hop_server is None
        capability = admission.capability
        assert capability is not None and capability.result == "failed"
        assert capability.failure, "the record says why"
        nursery.cancel_scope.cancel()
