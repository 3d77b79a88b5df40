"""Per-component random streams derived from one run seed.

Every source of randomness in a simulation (the network, each node's
protocol core, each restart of a node, the workload) gets its own
``random.Random``, seeded from ``sha256(run seed, component name)``. Two
reasons:

- Reproducibility: the stream a component sees depends only on the run seed
  and its name, never on Python's per-process salted ``hash()`` or on object
  ids, so the same seed replays the same run in any process.
- Isolation: adding a draw in one component (say, a new jitter sample in the
  network) does not shift every other component's stream, so a change in one
  place does not turn every other seed's behaviour into a different run.
"""

from __future__ import annotations

import hashlib
import random

_DOMAIN = b"shardmesh/sim/seed/1\x00"
_SEED_BYTES = 8
"""64 bits of seed per component: ample to keep streams apart, cheap to hash."""


def derive_seed(seed: int, *names: str | int) -> int:
    """A 64-bit seed for the component named by ``names`` in run ``seed``."""
    digest = hashlib.sha256(_DOMAIN + repr((seed, *names)).encode()).digest()
    return int.from_bytes(digest[:_SEED_BYTES], "big")


def component_rng(seed: int, *names: str | int) -> random.Random:
    """The component's own ``random.Random`` (see the module docstring)."""
    return random.Random(derive_seed(seed, *names))
