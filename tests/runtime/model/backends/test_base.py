"""The backend interface (`runtime.model.backends.base`): where a shard sits
in its model decides what it takes and returns."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.model.backends.base import KVCache, ShardPosition, ShardSpec


class Placed(ShardPosition):
    def __init__(self, start: int, end: int, layers: int) -> None:
        self.spec = ShardSpec(Path("/m"), start, end, "fp32")
        self.num_layers = layers


@pytest.mark.parametrize(
    ("start", "end", "first", "last"),
    [(0, 8, True, True), (0, 3, True, False), (3, 6, False, False), (6, 8, False, True)],
)
def test_first_and_last_follow_the_span(start: int, end: int, first: bool, last: bool) -> None:
    shard = Placed(start, end, 8)
    assert (shard.is_first, shard.is_last) == (first, last)


def test_a_spec_is_a_frozen_value() -> None:
    assert ShardSpec(Path("/m"), 0, 2, "q8") == ShardSpec(Path("/m"), 0, 2, "q8")
    with pytest.raises(AttributeError):
        ShardSpec(Path("/m"), 0, 2, "q8").start = 1  # type: ignore[misc]
    assert isinstance(KVCache(), KVCache)
