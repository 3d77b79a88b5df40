"""The WAN lab as a pytest fixture, for any test folder that needs one.

`make_lab(spec)` builds a `runtime.lab.netns.Lab` from a spec dict (or a
`Topology`) for one test and removes it after, whatever happened; where
namespaces cannot be made here (not root, no nft, no TUN) the test skips
and says why. A conftest takes it in with `from tests.runtime.lab.fixtures
import make_lab` (tests/runtime/lab/conftest.py does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import pytest

from runtime.lab.netns import Lab, unavailable
from runtime.lab.topology import Topology, load_topology

MakeLab: TypeAlias = Callable[[Topology | dict[str, Any]], Lab]


def skip_without_lab() -> None:
    """Skip the calling test, saying why, where no lab can be built."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no WAN lab here: {reason}")


@pytest.fixture
def make_lab() -> Iterator[MakeLab]:
    skip_without_lab()
    labs: list[Lab] = []

    def make(spec: Topology | dict[str, Any]) -> Lab:
        lab = Lab(spec if isinstance(spec, Topology) else load_topology(spec))
        labs.append(lab)
        return lab.__enter__()

    yield make
    for lab in labs:
        lab.close()
