"""The swarm view: one read model, and one definition of *admitted*.

A real membership driver on loopback ZeroMQ and a real ledger replica: the
node publishes its own record, commits its own assignment, and the view is
asked what chat and placement would ask.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from consensus.commands import Assign, Verdict, encode_command
from consensus.ledger import PlacementLedger
from consensus.placement import capability_state
from mesh.config import MembershipConfig
from mesh.identity import Identity, node_id_text
from mesh.records import (
    Addresses,
    Assignment,
    BackendInfo,
    CapabilityReport,
    NodeRecord,
    encode_record_body,
)
from mesh.transport import open_planes
from runtime.node.membership_driver import MembershipDriver
from runtime.node.state_dir import StateDir
from runtime.node.swarm_view import SwarmView

LOOPBACK = "tcp://127.0.0.1:0"
MODEL = "m"
SHARD = Assignment(MODEL, (0, 4), "fp32", "operator", False, 1)


def report(
    layers: tuple[int, int] = (0, 4), *, result: str = "admitted", expires_in: float = 600.0
) -> CapabilityReport:
    now = time.time()
    return CapabilityReport(
        result=result,  # type: ignore[arg-type]
        model=MODEL,
        manifest_digest="ab" * 32,
        layers=layers,
        recipe="fp32",
        backend="torch",
        prefill_tokens_per_s=100.0,
        decode_tokens_per_s=10.0,
        validated_at=now - 1.0,
        expires_at=now + expires_in,
        failure=None if result == "admitted" else "probe mismatch",
    )


def test_admitted_means_an_unexpired_admitted_report_about_exactly_the_shard() -> None:
    now = time.time()
    assert capability_state(report(), SHARD, now) == "admitted"
    assert capability_state(report(), None, now) == "none"
    assert capability_state(None, SHARD, now) == "none"
    # A report about another span proves nothing about this one.
    assert capability_state(report((0, 3)), SHARD, now) == "none"
    assert capability_state(report(expires_in=-1.0), SHARD, now) == "none"
    assert capability_state(report(result="failed"), SHARD, now) == "failed"


async def test_the_view_reads_records_and_loading_follows_the_one_definition(
    tmp_path: Path,
) -> None:
    identity = Identity.generate()
    me = node_id_text(identity.node_id)
    ledger = PlacementLedger()
    keys = identity.plane_keys()
    async with open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=keys) as (control, data):
        with StateDir(tmp_path) as state:
            driver = MembershipDriver(
                identity=identity,
                state=state,
                config=MembershipConfig.profile("local"),
                plane=control,
                address=control.address,
                incarnation=state.next_incarnation(),
                on_consensus=lambda sender, payload: None,
            )
            view = SwarmView(driver, lambda: ledger)

            def publish(capability: CapabilityReport | None, models: tuple[str, ...]) -> None:
                record = NodeRecord(
                    addresses=Addresses(control.address, data.address, "http://127.0.0.1:1"),
                    started_at=0.0,
                    backend=BackendInfo("torch", "cpu", 2**30),
                    assignment=SHARD,
                    capability=capability,
                    models=models,
                )
                driver.publish_record(encode_record_body(record))

            assert view.member_api(identity.node_id) is None  # no record yet
            publish(None, ("m", "n"))
            assert view.member_api(identity.node_id) == "http://127.0.0.1:1"
            assert view.member_state(identity.node_id) == "alive"
            assert view.assigned_models() == {MODEL}
            assert view.stored_models() == {"m", "n"}
            assert view.known_models() == {"m", "n"}  # demand may be committed for these
            assert view.loading_nodes(MODEL) == [me]
            assert view.loading_nodes("n") == []  # stored, not assigned
            assert not view.coverage().models

            publish(report(), ("m",))
            assert view.loading_nodes(MODEL) == []
            assert {key.model for key in view.coverage().models} == {MODEL}

            # The ledger now says another span: the report no longer admits it.
            assign = Assign(identity.node_id, MODEL, (0, 2), "fp32", "bootstrap", False, 1, 0.0)
            assert ledger.apply(1, encode_command(assign)).accepted
            assert view.loading_nodes(MODEL) == [me]
            assert "n" not in view.known_models()  # no longer stored by anyone

            # A model only the ledger assigns (its node's record says nothing yet).
            other = Assign(b"\x07" * 32, "ledger-only", (0, 2), "fp32", "bootstrap", False, 1, 0.0)
            assert ledger.apply(2, encode_command(other)).accepted
            assert view.known_models() == {MODEL, "ledger-only"}

            # A guilty verdict: whatever its report says, the node serves
            # nothing while its quarantine holds, and the map says why.
            assert view.coverage().excluded == {}
            verdict = Verdict(identity.node_id, b"\x08" * 32, b"\x09" * 32, True, time.time())
            assert ledger.apply(3, encode_command(verdict)).accepted
            coverage = view.coverage()
            assert coverage.excluded == {identity.node_id: "quarantined"}
            assert [entry.nodes for entry in coverage.models.values()] == [()]
