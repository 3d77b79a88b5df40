"""The protocol cores in virtual time: event loop, simulated network, faults,
membership and Raft clusters, placement, and scenarios (ARCHITECTURE.md
maps the modules; docs/simulation.md says how to run them).

Importing this package first honours `SHARDMESH_SIM_CORE` (run the hot
modules from a compiled build: `simulations.compiled`), so the names below
are imported when first used, not here: anything imported here would be
imported from source before the compiled build could take its place.
"""

import importlib
from typing import Any

from simulations.compiled import use_from_environment

use_from_environment()

_EXPORTS = {
    "EventLoop": "simulations.loop",
    "MembershipCluster": "simulations.cluster",
    "Network": "simulations.network",
    "NetworkConfig": "simulations.network",
    "NodeStatus": "simulations.cluster",
    "Publication": "simulations.cluster",
    "SimSigner": "simulations.signing",
    "Timer": "simulations.loop",
    "run_scenario": "simulations.scenario",
    "sim_verify": "simulations.signing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'simulations' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
