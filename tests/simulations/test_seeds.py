"""Per-component random streams: a pure function of the run seed and the
component's name, apart from every other component's stream."""

from __future__ import annotations

import subprocess
import sys

from simulations.seeds import component_rng, derive_seed
from tests import REPO


def test_a_derived_seed_is_64_bits_and_depends_on_the_seed_and_every_name() -> None:
    seeds = {
        derive_seed(1, "network"),
        derive_seed(2, "network"),
        derive_seed(1, "node", 0),
        derive_seed(1, "node", 1),
        derive_seed(1, "node", "1"),
        derive_seed(1, "node"),
    }
    assert len(seeds) == 6
    assert all(0 <= seed < 2**64 for seed in seeds)
    assert derive_seed(1, "node", 3) == derive_seed(1, "node", 3)


def test_a_stream_is_the_same_in_another_process() -> None:
    """No salted hash() or object ids: a seed replays in any process."""
    code = "from simulations.seeds import derive_seed; print(derive_seed(42, 'placement', 'swim'))"
    there = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert int(there.stdout) == derive_seed(42, "placement", "swim")


def test_drawing_from_one_stream_does_not_shift_another() -> None:
    alone = component_rng(7, "network").random()
    busy = component_rng(7, "workload")
    for _ in range(1_000):
        busy.random()
    assert component_rng(7, "network").random() == alone
    assert component_rng(7, "workload").random() != component_rng(7, "network").random()
