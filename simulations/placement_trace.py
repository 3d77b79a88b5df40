"""The placement simulation's own traced events, and the merged timeline.

Every collaborator of `simulations.placement_cluster` notes what it did
here (a load, a doctor's verdict, a crash, a commit, a caught lie), stamped
with the virtual time. The running digest is what makes "same seed, same
run" one string comparison; with `keep` the lines are kept too, and
`merge_timeline` interleaves them with Raft's and SWIM's traced events for
`shardmesh simulate --out` (see docs/simulation.md, "What a run records").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from simulations.loop import EventLoop

__all__ = ["Trace", "merge_timeline"]


class Trace:
    """A digest of every noted event, and the lines themselves when kept."""

    def __init__(self, loop: EventLoop, *, keep: bool = False) -> None:
        self._loop = loop
        self._digest = hashlib.sha256()
        self.lines: list[str] | None = [] if keep else None
        """With `keep`: every noted line, `TIME EVENT`, in the order noted."""

    def note(self, line: str) -> None:
        """Record `line` at the loop's time (six decimals, as Raft's trace)."""
        text = f"{self._loop.now:.6f} {line}"
        self._digest.update(text.encode() + b"\n")
        if self.lines is not None:
            self.lines.append(text)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def merge_timeline(raft: Sequence[str], mine: Sequence[str], swim: Sequence[str]) -> list[str]:
    """Raft's traced lines, placement's and SWIM's (`TIME OBSERVER KIND
    SUBJECT N`, shown as `TIME swim OBSERVER ...`) in time order, and in
    that order at equal times."""
    return [line for _, _, line in sorted(
        [(float(line.split()[0]), 0, line) for line in raft]
        + [(float(line.split()[0]), 1, line) for line in mine]
        + [(float(line.split(" ", 1)[0]), 2, line.replace(" ", " swim ", 1)) for line in swim],
        key=lambda item: (item[0], item[1]),
    )]  # fmt: skip
