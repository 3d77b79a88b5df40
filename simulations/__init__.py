"""The protocol cores in virtual time: event loop, simulated network, faults,
membership clusters and scenarios (see DESIGN.md, "simulations/")."""

from simulations.cluster import MembershipCluster, NodeStatus, Publication
from simulations.loop import EventLoop, Timer
from simulations.network import Network, NetworkConfig
from simulations.scenario import run_scenario
from simulations.signing import SimSigner, sim_verify

__all__ = [
    "EventLoop",
    "MembershipCluster",
    "Network",
    "NetworkConfig",
    "NodeStatus",
    "Publication",
    "SimSigner",
    "Timer",
    "run_scenario",
    "sim_verify",
]
