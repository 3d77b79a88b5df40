"""Fault: the node's capability report claims a decode rate it does not have.

``SHARDMESH_TEST_FAULT=claim_speed:5.4e11`` makes every capability report
the node signs state 5.4e11 decode tokens/s, whatever its doctor measured;
everything else (the doctor, the shard, what it computes and the compute
times it reports) stays honest. This is the node of issue 18 that carried
every request by its claim alone.
"""

from __future__ import annotations

import dataclasses

from mesh import records
from runtime.model.doctor import DoctorReport
from runtime.node import admission


def install(argument: str) -> None:
    """Replace the function the admission calls for every report it publishes
    (looked up as a module attribute at call time, so patching it here, at
    interpreter start, takes effect)."""
    rate = float(argument)
    honest = admission._capability

    def claiming(
        report: DoctorReport, options: admission.ServeOptions
    ) -> records.CapabilityReport | None:
        capability = honest(report, options)
        if capability is None:
            return None
        return dataclasses.replace(capability, decode_tokens_per_s=rate)

    admission._capability = claiming
