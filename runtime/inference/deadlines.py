"""How long the entry waits for a step of a chain, and which hop held up one that ran out.

Volunteers' hops differ in speed by orders of magnitude, so a step's
deadline follows from what each hop of the chain is expected to take
(`HopPace`, from what this entry observed, else what the hop's capability
report states): `floor_s + factor * sum(expected)`, capped
(`Deadlines.step_s`). When a step runs out anyway, `find_stall` names the
hop that held it up the most times its expectation, from when each hop's
commitment for the step arrived. Sans-IO: nothing here reads a clock.

Why a fixed timeout fails, and the rule in full:
docs/design/inference-protocol.md#deadlines-and-stalls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from mesh.routes import MIN_DECODE_TOKENS_PER_S

__all__ = [
    "BATCHED_STEP_STRETCH",
    "CHUNKED_PREFILL_STRETCH",
    "DEADLINE_CEILING_S",
    "DEADLINE_FACTOR",
    "DEADLINE_FLOOR_S",
    "DEFAULT_DEADLINES",
    "OPEN_S",
    "UNMEASURED_PACE",
    "Deadlines",
    "HopPace",
    "Stall",
    "expected_pace",
    "find_stall",
]

DEADLINE_FLOOR_S: Final = 2.0
"""What every step is given on top of its hops' expected time. It covers
what no per-hop figure predicts: a garbage-collection pause or a busy event
loop on a loaded volunteer, a lost segment's retransmission (at least
200 ms on Linux), a chain's WAN latency when the hops' figures are their
doctors' (measured alone on the node, without the network). On a fast
chain, whose steps take milliseconds, it is nearly the whole deadline, as
the fixed 2 s decode timeout was: short enough that the stall a dead hop
causes is a pause a streaming client sees, not a hang."""

DEADLINE_FACTOR: Final = 4.0
"""How many times its expected time a step may take before it is given up.
A healthy hop's step strays from its measured time by: sharing its device
with its other sessions (at a load of rho a queue's service takes
1/(1 - rho) as long, as routes price it: 4x at three-quarters full), the
doctor timing a 32-token prefill where a long prompt's attention costs
more per token, a laptop's thermal throttling (up to about 2x). Giving up
costs a replay of the whole history on another chain, about as much as the
step itself, so abandoning a step that would have finished within a few
times its expectation loses time instead of saving it. A hop at a quarter
of its measured speed is degraded, and routing around it is right."""

DEADLINE_CEILING_S: Final = 600.0
"""The longest any step waits, whatever the hops' figures say: a node's
stated speed is its own word, and one that states a few tokens a second
would otherwise hold a generation for as long as it likes. Ten minutes is
longer than the clients and proxies in front of a chat API wait for a first
token (one to ten minutes), so no answer anyone still waits for is cut."""

OPEN_S: Final = 2.0
"""For every hop of a chain to answer ``open``: one round trip each, all in
parallel, and allocating an empty cache, whatever the hops' speed."""

_TINY_S: Final = 1e-6
"""A microsecond, the resolution of the hops' compute reports: the least a
hop is expected to take when comparing how long it held a step with it."""


@dataclass(frozen=True, slots=True)
class HopPace:
    """What the entry expects one hop to take.

    ``prefill_s_per_token``: seconds per position of a prefill (a prompt, or
    a replay after failover). ``decode_step_s``: seconds per one-token step,
    which is also what any step costs beyond its tokens (the messages, the
    hop's wake-up, the sampling on the last hop).
    """

    prefill_s_per_token: float
    decode_step_s: float

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_step_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"HopPace.{name} must be finite and >= 0, got {value!r}")

    def step_s(self, tokens: int, *, prefill: bool) -> float:
        """The expected seconds of a step of ``tokens`` positions: a prefill
        (the chain's first step), or a decode step."""
        return self.decode_step_s + (tokens * self.prefill_s_per_token if prefill else 0.0)

    def slowed(self, factor: float) -> HopPace:
        """This pace ``factor`` times slower (a hop that held a step
        ``factor`` times as long as expected)."""
        return HopPace(self.prefill_s_per_token * factor, self.decode_step_s * factor)


BATCHED_STEP_STRETCH: Final = 4.0
"""How many times its lone decode step a loaded hop's step is expected to
take. A hop runs the decode steps that wait for its shard as one batched
forward (`runtime.inference.batcher`), up to `batcher.MAX_BATCH_ROWS`
sessions' steps, and each of them takes the whole batch's time: on the
development CPU a full batch of 16 took 36-58 ms at 32-128 positions of
context, 3-4x a step alone (docs/design/batching.md); a GPU, whose decode
step is bound by reading the weights, takes less. A node's stated decode
rate is its doctor's, of one step alone, so the step it states is
stretched by this; a step the entry observed is not (it took whatever
batches the hop ran). `DEADLINE_FACTOR` then allows for the wait behind
the forward already running, as for any queue."""

CHUNKED_PREFILL_STRETCH: Final = 2.0
"""How many times its lone prefill time a loaded hop's prefill is expected
to take. A hop whose other sessions are decoding prefills a long prompt in
chunks that each take about one of their decode batches' time, and runs a
batch between two chunks (docs/design/batching.md#chunked-prefill): the
prompt gets about half the shard, so it takes about twice its compute
(plus the chunks' own overhead, which `batcher.MIN_CHUNK_TOKENS`
bounds). A node's stated prefill rate is its doctor's, alone, so it is
stretched by this; an observed one is not (the hop reports the prefill's
time from its first chunk to its last, yields included)."""

UNMEASURED_PACE: Final = HopPace(prefill_s_per_token=0.005, decode_step_s=0.05)
"""For a hop the caller has no figure for (a spot check's replay, a test):
200 prompt tokens and 20 steps a second, a 7B-class model's span on a
modest GPU. Generous on purpose: a hop nobody measured may be slow, and a
wrong guess should cost a longer wait on a dead hop, not a failed prompt."""


def expected_pace(
    *,
    claimed_prefill_tokens_per_s: float | None,
    claimed_decode_tokens_per_s: float | None,
    observed_prefill_s_per_token: float | None = None,
    observed_step_s: float | None = None,
) -> HopPace:
    """What to expect of a node: what this entry observed it take where it
    has (`mesh.observed_speed.ObservedSpeeds`), else what its capability
    report states its doctor measured (a lone step's, so a decode step is
    expected to take `BATCHED_STEP_STRETCH` times it: the hop may be
    running a full batch; and a prefill `CHUNKED_PREFILL_STRETCH` times
    its stated rate's: it may yield to those batches), else (no report:
    None) `UNMEASURED_PACE`.

    A stated decode rate of 0 (measurement missing) counts as
    `mesh.routes.MIN_DECODE_TOKENS_PER_S`, as routes price it; a stated
    prefill rate of 0 as the decode step per token (a prefill is never
    slower than its tokens one step at a time)."""
    claimed_step = None
    if claimed_decode_tokens_per_s is not None:
        claimed_step = 1.0 / max(claimed_decode_tokens_per_s, MIN_DECODE_TOKENS_PER_S)
    if observed_step_s is not None:
        step = observed_step_s
    elif claimed_step is not None:
        step = claimed_step * BATCHED_STEP_STRETCH
    else:
        step = UNMEASURED_PACE.decode_step_s
    if observed_prefill_s_per_token is not None:
        per_token = observed_prefill_s_per_token
    elif claimed_prefill_tokens_per_s is None:
        per_token = UNMEASURED_PACE.prefill_s_per_token
    elif claimed_prefill_tokens_per_s > 0:
        lone = 1.0 / max(claimed_prefill_tokens_per_s, MIN_DECODE_TOKENS_PER_S)
        per_token = lone * CHUNKED_PREFILL_STRETCH
    elif observed_step_s is None and claimed_step is not None:
        per_token = claimed_step  # no slower than its tokens one lone step at a time
    else:
        per_token = step
    return HopPace(per_token, step)


@dataclass(frozen=True, slots=True)
class Deadlines:
    """The rule that turns the hops' expected times into a step's deadline
    (see the module docstring): ``floor_s + factor * sum``, at most
    ``ceiling_s``; ``open_s`` for the sessions to open."""

    open_s: float = OPEN_S
    floor_s: float = DEADLINE_FLOOR_S
    factor: float = DEADLINE_FACTOR
    ceiling_s: float = DEADLINE_CEILING_S

    def __post_init__(self) -> None:
        if not self.open_s > 0:
            raise ValueError("Deadlines.open_s must be positive")
        if not 0 < self.floor_s <= self.ceiling_s < math.inf:
            raise ValueError("Deadlines need 0 < floor_s <= ceiling_s < inf")
        if not 1 <= self.factor < math.inf:
            raise ValueError("Deadlines.factor must be at least 1")

    def step_s(self, expected: Sequence[float]) -> float:
        """How long to wait for a step whose hops are expected to take
        ``expected`` seconds each."""
        return min(self.ceiling_s, self.floor_s + self.factor * math.fsum(expected))


DEFAULT_DEADLINES: Final = Deadlines()


@dataclass(frozen=True, slots=True)
class Stall:
    """The hop that held up a step that ran out of time.

    ``held_s`` is how long it held the step (at least that long when it is
    ``silent``: it had not reported the step when the deadline passed);
    ``expected_s`` is what it was expected to take.
    """

    index: int
    node: str
    held_s: float
    expected_s: float
    silent: bool

    @property
    def slowdown(self) -> float:
        """How many times its expected time the hop held the step."""
        return self.held_s / max(self.expected_s, _TINY_S)


def find_stall(
    nodes: Sequence[str],
    expected: Sequence[float],
    sent_at: float,
    reported_at: Sequence[float | None],
    now: float,
) -> Stall:
    """Which hop of a chain held up a step sent at ``sent_at`` that had not
    produced its token by ``now``.

    ``expected`` is each hop's expected time for the step, ``reported_at``
    when its report of the step (its commitment) reached the entry, or None.
    Hops run one after another: a hop that reported held the step from the
    latest earlier report (or ``sent_at``) to its own; the hop after the
    last one that reported holds it still (silent), and the hops after that
    have not started. A report that went missing in between merges its
    hop's time into the next reporting hop's. The hop that held the step the
    most times its expectation is the stall; a tie goes to the earlier hop,
    except that a silent hop wins a tie (it is the one still holding)."""
    if not len(nodes) == len(expected) == len(reported_at) or not nodes:
        raise ValueError("one expected time and one report slot per hop are needed")
    reporting = [i for i, at in enumerate(reported_at) if at is not None]
    stuck = reporting[-1] + 1 if reporting else 0
    candidates: list[Stall] = []
    start = sent_at
    for i in range(min(stuck + 1, len(nodes))):
        at = reported_at[i]
        if i == stuck:
            candidates.append(Stall(i, nodes[i], max(0.0, now - start), expected[i], True))
        elif at is not None:
            candidates.append(Stall(i, nodes[i], max(0.0, at - start), expected[i], False))
            start = max(start, at)
    return max(candidates, key=lambda stall: (stall.slowdown, stall.silent, -stall.index))
