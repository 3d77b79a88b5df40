"""What an entry keeps of a generation to spot-check it, and how a check judges it.

A `Transcript` holds one generation's chain, the projection seed the entry
gave each hop, the tokens and every hop's signed commitment, keyed by (hop
index, step). A spot check replays the history on other nodes, and
`find_divergence` walks the original steps in order, hops in chain order,
and stops at the first position where a commitment disagrees with the
recomputation (`output`, `token`, `input`, `transit` or `missing`): only
the first divergence is evidence. Pure functions and data: no I/O.

What each kind of divergence means: docs/design/verified-compute.md#transcripts-and-divergence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

import numpy as np

from runtime.inference.commitment import Commitment, ids_digest
from runtime.model.sampling import SamplingParams

__all__ = [
    "Divergence",
    "DivergenceKind",
    "Replay",
    "Transcript",
    "find_divergence",
    "judge_step",
    "rows_agree",
]

_TINY: Final = 1e-30

DivergenceKind = Literal["output", "token", "input", "transit", "missing"]


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a check found the first disagreement (see the module docstring).

    ``hop_index`` is the accused's place in the chain (for ``transit``, the
    receiving hop; the sender is the one before it); ``commitment`` is the
    accused's signed commitment, the evidence, when there is one."""

    kind: DivergenceKind
    hop_index: int
    step: int
    commitment: Commitment | None
    detail: str


@dataclass
class Transcript:
    """One generation as its entry saw it: kept up to date by
    :meth:`runtime.inference.chain.Pipeline.generate` (and, for a replay,
    by :meth:`runtime.inference.chain.Pipeline.replay`)."""

    model: str = ""
    prompt: tuple[int, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    chain_nodes: list[bytes] = field(default_factory=list)
    chain_layers: list[tuple[int, int]] = field(default_factory=list)
    sketch_seeds: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    attempts: int = 0
    commitments: dict[tuple[int, int], Commitment] = field(default_factory=dict)
    refused: int = 0
    """Commitments not kept: a second one for the same hop and step."""
    relays: dict[tuple[int, int], tuple[bytes, bytes]] = field(default_factory=dict)
    """(hop index, step) -> the digest of the commitment the hop before it
    sent it with that step's rows, and that hop's receipt signature: what
    `runtime.inference.blame.find_equivocation` compares with the
    commitment the sender sent the entry."""
    receipts: dict[tuple[int, int], bytes] = field(default_factory=dict)
    """The last hop's receipt signature for each token it emitted, checked
    before the token was (`runtime.inference.blame.check_emitted`): it
    proves that step's commitment (`runtime.inference.blame.receipted`)."""

    def begin(
        self, model: str, prompt: tuple[int, ...], sampling: SamplingParams, seed: int
    ) -> None:
        """A generation starts: its request, and no tokens yet."""
        self.model, self.prompt = model, prompt
        self.sampling, self.seed = sampling, seed
        self.tokens.clear()

    def restart(
        self, nodes: Sequence[bytes], layers: Sequence[tuple[int, int]], seeds: Sequence[int]
    ) -> None:
        """A new chain (the first, or one after a failover): commitments
        are only comparable within one chain, so the old ones go."""
        self.attempts += 1
        self.chain_nodes = list(nodes)
        self.chain_layers = list(layers)
        self.sketch_seeds = list(seeds)
        self.commitments.clear()
        self.receipts.clear()
        self.relays.clear()

    def add(self, hop_index: int, commitment: Commitment) -> None:
        key = (hop_index, commitment.step)
        if key in self.commitments:
            self.refused += 1
            return
        self.commitments[key] = commitment

    def seal(self, hop_index: int, step: int, signature: bytes) -> None:
        """The hop's signature of its last commitment, sent at the close;
        kept only for a commitment that has none yet (it is checked when
        the commitment becomes evidence)."""
        found = self.commitments.get((hop_index, step))
        if found is not None and not found.signature:
            self.commitments[(hop_index, step)] = replace(found, signature=signature)

    def links(self, hop_index: int, step: int) -> tuple[Commitment, ...]:
        """The hop's commitments after ``step``, up to its next signed one:
        what proves an unsigned commitment (`Commitment.verified_through`)."""
        chain = []
        later = sorted(s for (i, s) in self.commitments if i == hop_index and s > step)
        for following in later:
            commitment = self.commitments[(hop_index, following)]
            chain.append(commitment)
            if commitment.signature:
                break
        return tuple(chain)

    def complete(self) -> bool:
        """Every hop's commitment for every step is in, and each hop's
        latest one is signed (its seal came): the chains prove them all."""
        hops = len(self.chain_nodes)
        steps = self.steps()
        if not steps or len(self.commitments) < hops * len(steps):
            return False
        latest: dict[int, int] = {}
        for index, step in self.commitments:
            latest[index] = max(step, latest.get(index, step))
        return len(latest) == hops and all(
            self.commitments[(index, step)].signature for index, step in latest.items()
        )

    def proven(self, hop_index: int, step: int) -> bool:
        """The hop signed its commitment for ``step``, itself or through
        the links after it."""
        commitment = self.commitments[(hop_index, step)]
        return commitment.verified_through(self.links(hop_index, step))

    def steps(self) -> list[int]:
        """The steps this chain ran, in order (from the first hop's commitments
        and the tokens: a step whose first-hop commitment is missing still
        produced a token)."""
        first_step = min((step for (_, step) in self.commitments), default=0)
        return list(range(first_step, len(self.tokens)))


@dataclass(frozen=True, slots=True)
class Replay:
    """A recomputation's result: one commitment per hop of the checking
    chain (one step, every position), and the last hop's verdict on each
    claimed token (``picks``: what it would emit, ``margins``: how far the
    claim is, see :func:`runtime.model.sampling.token_margin`)."""

    commitments: tuple[Commitment, ...]
    picks: tuple[int, ...]
    margins: tuple[float, ...]
    collected: Transcript | None = None
    """The replay's own chain as its entry saw it (its commitments and the
    receipts the hops relayed): a hop of the replay may lie in it too, and
    only this shows it (`runtime.inference.blame.find_equivocation`)."""


def rows_agree(claimed: np.ndarray, recomputed: np.ndarray, tolerance: float) -> bool:
    """Every row of ``claimed`` within ``tolerance`` of ``recomputed``, by the
    doctor's measure (`runtime.model.recipes.relative_error`) row by row:
    the worst element's error on the scale of the recomputed row."""
    if claimed.shape != recomputed.shape or claimed.shape[0] == 0:
        return False
    diff = np.abs(claimed.astype(np.float64) - recomputed.astype(np.float64)).max(axis=1)
    scale = np.maximum(np.abs(recomputed.astype(np.float64)).max(axis=1), _TINY)
    return bool((diff / scale <= tolerance).all())


def find_divergence(transcript: Transcript, replay: Replay, tolerance: float) -> Divergence | None:
    """The first disagreement between a generation's commitments and a
    recomputation of it (see the module docstring), or None when every
    commitment agrees within ``tolerance``.

    The replay ran the ids ``prompt + tokens[:-1]`` from position 0 and
    judged the tokens from position ``len(prompt) - 1`` on.
    """
    for step in transcript.steps():
        for index in range(len(transcript.chain_nodes)):
            found = judge_step(transcript, replay, index, step, tolerance)
            if found is not None:
                return found
    return None


def judge_step(
    transcript: Transcript, replay: Replay, index: int, step: int, tolerance: float
) -> Divergence | None:
    """One hop's commitment for one step against the recomputation (None:
    it agrees). The leader judges evidence with this alone: a commitment
    from a generation, or from a spot check's own replay (one step over the
    whole history, whose last hop committed the logits of every judged
    position rather than one token)."""
    claimed = transcript.commitments.get((index, step))
    if claimed is None:
        return Divergence("missing", index, step, None, "no commitment for this step")
    rows = slice(claimed.pos, claimed.pos + claimed.count)
    checking = replay.commitments[index]
    if index == 0:
        ids = np.array([*transcript.prompt, *transcript.tokens], dtype=np.int64)
        if claimed.inputs_digest != ids_digest(ids[rows]):
            return Divergence("input", 0, step, claimed, "committed to ids it was not sent")
    elif not rows_agree(claimed.inputs, checking.inputs[rows], tolerance):
        return Divergence("transit", index, step, claimed, "input differs from what was sent")
    if index < len(transcript.chain_nodes) - 1:
        if not rows_agree(claimed.outputs, checking.outputs[rows], tolerance):
            return Divergence("output", index, step, claimed, "output differs from recomputation")
        return None
    # The token this step emitted, counted from the replay's first judged position.
    judged = claimed.pos + claimed.count - len(transcript.prompt)
    rows_out = claimed.outputs.shape[0]
    if rows_out > 1:  # a replay's own commitment: the logits of every judged position
        span = slice(judged + 1 - rows_out, judged + 1)
        if span.start < 0 or not rows_agree(claimed.outputs, checking.outputs[span], tolerance):
            return Divergence("output", index, step, claimed, "logits differ from recomputation")
        return None
    if not 0 <= judged < len(replay.picks) or claimed.token != transcript.tokens[step]:
        return Divergence("token", index, step, claimed, "commitment names another token")
    if not rows_agree(claimed.outputs, checking.outputs[judged : judged + 1], tolerance):
        return Divergence("output", index, step, claimed, "logits differ from recomputation")
    if replay.picks[judged] != claimed.token and replay.margins[judged] > tolerance:
        return Divergence(
            "token",
            index,
            step,
            claimed,
            f"emitted {claimed.token}, recomputation gives {replay.picks[judged]} "
            f"(margin {replay.margins[judged]:.3g})",
        )
    return None
