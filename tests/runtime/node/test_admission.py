"""Admission: the doctor gates a shard, the slot serves what passed, the record follows.

A real tiny model (torch on CPU), the real doctor, a real engine on loopback.
The doctor's own checks are in tests/runtime/model/test_doctor.py.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import trio

from mesh.identity import Identity
from mesh.transport import open_planes
from runtime.inference.dispatch import Engine
from runtime.model.tiny import make_tiny_model
from runtime.node.admission import ServeOptions, ShardSlot, probe_backend

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
