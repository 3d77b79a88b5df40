"""Verified compute benchmark: how soon a lying hop is caught, that honest
hops are not, and what checking costs, beside the anchors.

    python -m benchmarks.verify [--json] [--quick] [--seed N]

Everything runs in this process on real parts: CurveZMQ planes, engines and
hop servers holding torch shards of the tiny model, three replicas per span,
the entry's real `SpotChecker` and the leader's real `Adjudicator`; only the
swarm's view is a fixed table (`StaticSwarm`). A liar that always lies and
one that lies on 1% of forwards are checked, 2,000 honest requests too, and
a wide model measures a commitment's cost per step. The full run takes
about ten minutes on 2 cores, `--quick` (the test's mode) about 20 s.
Progress goes to stderr; the last line printed is one JSON object. The
derivation and every key: docs/benchmarks.md#verify.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, cast

import numpy as np
import torch
import trio

from benchmarks.pipeline import serve_engine
from consensus.commands import Verdict
from consensus.settings import PlacementSettings
from mesh.coverage import CoverageKey, CoverageMap, ModelCoverage, ServingNode, recipe_class
from mesh.identity import Identity
from mesh.records import Addresses, NodeRecord
from runtime.inference.chain import ChainHop, ChainTiming, Pipeline
from runtime.inference.commitment import SIGN_EVERY, SKETCH_DIMS, Commitment, ids_digest, sketch
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import HopServer
from runtime.inference.transcript import Transcript
from runtime.model.backends import load_shard
from runtime.model.backends.base import KVCache, ShardBackend, ShardSpec
from runtime.model.sampling import SEED_MODULUS, SamplingParams
from runtime.model.tiny import make_tiny_model
from runtime.node.spot_check import Adjudicator, Evidence, SpotChecker

# --- the swarm ------------------------------------------------------------------

MODEL: Final = "tiny-qwen3"
LAYERS: Final = 8
SPANS: Final = ((0, 3), (3, 6), (6, 8))
"""Three hops, as the engine tests split the tiny model: the liar is the
middle one, whose input and output are both hidden states (the hardest
place to see from outside: neither the prompt nor the token is its own)."""
LIAR_HOP: Final = 1
REPLICAS: Final = 3
"""Nodes per span: the one that served and two to check it. An entry
reports a divergence only when a second replay, on other nodes again,
confirms it (`SpotChecker.check`), and the leader's recomputation avoids
the accused: each needs a replica of the accused's span that is neither."""
BACKEND: Final = "torch"
COMPUTE_THREADS: Final = 1
"""Torch threads for every forward here. The tiny model gains nothing from
threads, and on a small shared machine (2 cores, other processes busy)
OpenMP's spinning threads turn a 10 ms decode step of the wide model into
30-130 ms and a 40 ms prefill into 400 ms: one thread measures compute,
not contention. One thread makes the wide model's decode step ~25% slower
than two on an idle machine, which flatters the sketch's share by as much."""
CHECK_LOGGER: Final = "shardmesh.verify"
"""The spot checker's logger (`runtime.node.spot_check.log`)."""
LOOPBACK: Final = "tcp://127.0.0.1:0"
RECIPES: Final = ("fp32", "bf16", "q8")
"""One of each recipe class a volunteer's CPU or GPU commonly runs: full
precision, 16-bit floats and 8-bit weights."""

NOISE: Final = 0.5
"""A lie: noise of half the output's spread, as tests/runtime/inference/test_verify_engine.py's
liar ("three different garbage answers to three identical requests")."""
ONE_PERCENT: Final = 0.01

PROMPT_TOKENS: Final = (4, 24)
"""Prompt lengths drawn per request (inclusive): chat-turn-sized prompts in
the tiny model's units."""
DETECT_TOKENS: Final = 32
"""Tokens each request of a detection run generates: a short chat answer."""
HONEST_TOKENS: Final = 10
"""Tokens each honest request generates: fewer than a detection request's
so that 2,000 checked requests (and their 2,000 replays) fit the run's
ten minutes on 2 cores; every one still crosses the decode/prefill divide
the tolerance must absorb, and the 1,000 sampled ones make 10,000 sampled
steps for the token check to judge."""
GREEDY: Final = SamplingParams(temperature=0.0)
SAMPLED: Final = SamplingParams(temperature=0.9, top_p=0.95, top_k=50)

ADJUDICATE: Final = 5
"""Evidence judged by the leader per liar kind: each costs one replay, so
a few show the verdict without doubling the run."""
MAX_HONEST_ADJUDICATIONS: Final = 100
"""Evidence from honest runs judged by the leader (all of it, unless a
broken tolerance floods the run: then the first hundred say enough)."""


@dataclass(frozen=True)
class Counts:
    """How much each part measures (full or `--quick`)."""

    honest_requests: int
    always_requests: int
    one_percent_requests: int
    monte_carlo_trials: int
    sketch_hidden: int
    sketch_intermediate: int
    sketch_layers: int
    sketch_steps: int


FULL: Final = Counts(
    honest_requests=2000,
    always_requests=60,
    one_percent_requests=200,
    monte_carlo_trials=200_000,
    sketch_hidden=1024,
    sketch_intermediate=4096,
    sketch_layers=6,
    sketch_steps=64,
)
"""2,000 honest requests bound a false-quarantine rate near 0 (none in
2,000: under 0.15% at 95%); 200 checked requests measure the 1% liar's
p_detect (~0.27) to +-0.06 at 95%; the always-liar is caught by every
check or it is not: 60 of 60 put p_detect above 0.94 at 95%."""
QUICK: Final = Counts(
    honest_requests=18,
    always_requests=4,
    one_percent_requests=8,
    monte_carlo_trials=10_000,
    sketch_hidden=256,
    sketch_intermediate=1024,
    sketch_layers=3,
    sketch_steps=8,
)
"""Enough to run every path (the test's mode), not to measure."""

MONTE_CARLO_CAP: Final = 1_000_000
"""Requests a Monte-Carlo trial may serve before it counts as never caught."""
P99: Final = 0.99

TARGETS: Final = {
    "detect_requests_p99_always": 20,
    "detect_requests_p99_one_percent": 300,
    "false_quarantines": 0,
    "verify_overhead_fraction": 0.05,
    "sketch_cost_fraction": 0.02,
}
"""All upper bounds (issue 18)."""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class LyingShard:
    """A real shard that adds noise to its output on each forward with
    probability ``probability`` (1: always), from a seeded generator: an
    attacker's patched node, not a mock. A batched forward's rows are
    steps each, and each lies so. ``lies`` counts the outputs it corrupted."""

    def __init__(self, shard: ShardBackend, probability: float, seed: int) -> None:
        self._shard = shard
        self._probability = probability
        self._rng = np.random.default_rng(seed)
        self.lies = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray:
        return self._maybe_lie(self._shard.forward(inputs, positions, cache))

    def forward_batch(
        self, steps: Sequence[tuple[np.ndarray, np.ndarray, KVCache]]
    ) -> list[np.ndarray]:
        return [self._maybe_lie(output) for output in self._shard.forward_batch(steps)]

    def _maybe_lie(self, output: np.ndarray) -> np.ndarray:
        if self._rng.random() < self._probability:
            self.lies += 1
            noise = self._rng.standard_normal(output.shape).astype(np.float32)
            output = output + NOISE * float(output.std()) * noise
        return output


@dataclass
class Node:
    """A running node: its id, data address, engine and (if any) hop server."""

    node: bytes
    address: str
    engine: Engine
    span: tuple[int, int] | None = None
    recipe: str = "fp32"

    @property
    def hop(self) -> HopServer:
        assert self.engine.hop_server is not None
        return self.engine.hop_server

    def as_hop(self) -> ChainHop:
        assert self.span is not None
        return ChainHop(self.node.hex(), self.address, self.span)


async def start_node(
    nursery: trio.Nursery,
    shard: ShardBackend | None = None,
    span: tuple[int, int] | None = None,
    recipe: str = "fp32",
) -> Node:
    engine: Engine = await nursery.start(serve_engine, shard, MODEL)
    node = Node(engine.plane.keys.node_id, engine.plane.address, engine, span, recipe)
    return node


class StaticSwarm:
    """The swarm as the entry's and the leader's checks read it
    (`runtime.inference.swarm.SwarmReader`), from a fixed table of the
    benchmark's nodes instead of gossip: every node alive, every span
    served by each chain of its recipe class."""

    def __init__(self, entry: bytes, nodes: Sequence[Node]) -> None:
        self._entry = entry
        self._nodes = {node.node: node for node in nodes}

    @property
    def node_id(self) -> bytes:
        return self._entry

    def coverage(self) -> CoverageMap:
        by_class: dict[str, list[Node]] = {}
        for node in self._nodes.values():
            by_class.setdefault(recipe_class(node.recipe), []).append(node)
        models: dict[CoverageKey, ModelCoverage] = {}
        for klass, nodes in by_class.items():
            replicas = [0] * LAYERS
            serving = []
            for node in nodes:
                assert node.span is not None
                for layer in range(*node.span):
                    replicas[layer] += 1
                serving.append(ServingNode(node.node, "alive", node.span, node.recipe, 1.0, 1.0))
            entry = ModelCoverage(
                model=MODEL,
                manifest_digest="benchmark",
                recipe_class=klass,
                num_layers=LAYERS,
                covered=((0, LAYERS),),
                gaps=(),
                replicas=tuple(replicas),
                nodes=tuple(serving),
                complete=True,
            )
            models[entry.key] = entry
        return CoverageMap(models=models, excluded={})

    def record(self, node: bytes) -> NodeRecord | None:
        found = self._nodes.get(node)
        if found is None:
            return None
        return NodeRecord(addresses=Addresses(found.address, found.address), started_at=0.0)

    def dial_addresses(self, node: bytes) -> Addresses | None:
        record = self.record(node)
        return None if record is None else record.addresses


# --- requests and checks -----------------------------------------------------------


@dataclass
class Served:
    """One request as served and checked."""

    transcript: Transcript
    served_us: int
    served_wall_s: float
    replay_us: int = 0
    check_wall_s: float = 0.0
    divergences: Counter[str] = field(default_factory=Counter)
    counters: Counter[str] = field(default_factory=Counter)
    """The checker's counters for this check alone."""
    evidence: list[Evidence] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    """What the checker logged about a divergence (the kind, hop, step and
    why: for a token, the margin)."""


class CheckLog(logging.Handler):
    """Keeps what the spot checker logs, so a divergence's detail (which it
    only logs) lands in the JSON; installed on its logger for the run."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _seed(rng: np.random.Generator) -> int:
    """A sampling or projection seed, as an entry draws one (64 bits)."""
    return int(rng.integers(SEED_MODULUS, dtype=np.uint64))


def _request(rng: np.random.Generator, index: int, vocab: int) -> tuple[list[int], SamplingParams]:
    length = int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
    prompt = [int(t) for t in rng.integers(0, vocab, length)]
    return prompt, SAMPLED if index % 2 else GREEDY


async def serve_and_check(
    pipeline: Pipeline,
    checker: SpotChecker,
    reported: list[Evidence],
    check_log: CheckLog,
    chain: Sequence[ChainHop],
    swarm: Sequence[Node],
    prompt: Sequence[int],
    params: SamplingParams,
    seed: int,
) -> Served:
    """Serve one request on ``chain`` and spot-check it, as an entry does
    when it draws the request for a check (``SpotChecker.check``). The
    replay's compute is what every hop of ``swarm`` computed in prefills
    during the check: the served chain's own prefill is over by then."""
    timing = ChainTiming()
    transcript = Transcript()
    began = time.perf_counter()
    stream = pipeline.generate(
        MODEL, chain, prompt, params, seed=seed, timing=timing, transcript=transcript
    )
    async with aclosing(stream) as tokens:
        async for _ in tokens:
            pass
    served_wall = time.perf_counter() - began
    with trio.fail_after(5):  # a middle hop's last commitment may trail the last token
        while len(transcript.commitments) < len(chain) * len(transcript.steps()):
            await trio.sleep(0.002)
    served = Served(transcript, sum(timing.prefill_us) + sum(timing.decode_us), served_wall)
    before_counters = Counter(checker.counters)
    before_us = _prefill_us(swarm)
    logged = len(check_log.messages)
    began = time.perf_counter()
    await checker.check(transcript)
    served.check_wall_s = time.perf_counter() - began
    served.replay_us = _prefill_us(swarm) - before_us
    after = checker.counters - before_counters
    if not after["checked"]:
        raise RuntimeError(f"the check did not run: {dict(after)}")
    served.divergences = Counter(
        {k.removeprefix("divergence."): v for k, v in after.items() if k.startswith("divergence.")}
    )
    served.counters = after
    served.details = check_log.messages[logged:]
    served.evidence = reported[:]
    reported.clear()
    return served


def _prefill_us(nodes: Sequence[Node]) -> int:
    return round(sum(node.hop.stats.prefill_compute_s for node in nodes) * 1e6)


async def _replicas(
    nursery: trio.Nursery,
    shards: Sequence[ShardBackend],
    recipe: str,
    liar: LyingShard | None = None,
) -> list[list[Node]]:
    """``REPLICAS`` chains over SPANS, replicas of each other: the first
    with ``liar`` in its middle when given, the others honest. Replicas
    share the loaded shard objects (same weights, same recipe; each session
    has its own cache, and one forward runs at a time in this process)."""
    chains = []
    for replica in range(REPLICAS):
        served = list(shards)
        if liar is not None and replica == 0:
            served[LIAR_HOP] = cast(ShardBackend, liar)
        chains.append(
            [
                await start_node(nursery, shard, span, recipe)
                for shard, span in zip(served, SPANS, strict=True)
            ]
        )
    return chains


def _checker(entry: Node, nodes: Sequence[Node], reported: list[Evidence]) -> SpotChecker:
    async def report(evidence: Evidence) -> bool:
        reported.append(evidence)
        return True

    return SpotChecker(
        swarm=StaticSwarm(entry.node, nodes),
        pipeline=entry.engine.pipeline,
        fraction=lambda: 1.0,  # every request: p_detect is per *checked* request
        report=report,
    )


@dataclass
class HonestRun:
    """Honest requests of one recipe, and the leader's verdicts on any
    evidence their checks reported (each one a false accusation)."""

    recipe: str
    served: list[Served] = field(default_factory=list)
    verdicts: list[bool | None] = field(default_factory=list)


async def honest_run(
    entry: Node,
    shards: Sequence[ShardBackend],
    recipe: str,
    requests: int,
    seed: int,
    check_log: CheckLog,
) -> HonestRun:
    """``requests`` honest requests in ``recipe``, in turn on each of the
    ``REPLICAS`` chains, each checked on the others (the same recipe class:
    an entry's check stays in the checked chain's coverage variant); then
    the leader judges whatever evidence they reported."""
    reported: list[Evidence] = []
    rng = np.random.default_rng([seed, RECIPES.index(recipe)])
    run = HonestRun(recipe)
    async with trio.open_nursery() as nursery:
        chains = await _replicas(nursery, shards, recipe)
        nodes = [node for chain in chains for node in chain]
        checker = _checker(entry, nodes, reported)
        vocab = shards[-1].vocab_size
        for i in range(requests):
            serving = chains[i % REPLICAS]
            prompt, params = _request(rng, i, vocab)
            result = await serve_and_check(
                entry.engine.pipeline,
                checker,
                reported,
                check_log,
                [n.as_hop() for n in serving],
                nodes,
                prompt,
                replace(params, max_tokens=HONEST_TOKENS),
                _seed(rng),
            )
            run.served.append(result)
            if result.divergences:
                say(f"  {recipe} request {i}: DIVERGENCE {result.details}")
            if (i + 1) % 100 == 0 or i + 1 == requests:
                say(f"  {recipe}: {i + 1}/{requests} honest requests served and checked")
        evidence = [e for r in run.served for e in r.evidence][:MAX_HONEST_ADJUDICATIONS]
        run.verdicts, _ = await adjudicate(entry, nodes, evidence)
        nursery.cancel_scope.cancel()
    return run


async def adjudicate(
    entry: Node, nodes: Sequence[Node], evidence: Sequence[Evidence]
) -> tuple[list[bool | None], list[float]]:
    """The leader's verdict on each piece of ``evidence`` (as its API takes
    it: through JSON, checked on arrival), by its real `Adjudicator`, and
    the seconds each took. The entry's node plays the leader."""
    verdicts: list[bool | None] = []
    seconds: list[float] = []

    async def propose(verdict: Verdict) -> bool:
        return True  # committed: the ledger's quarantine is not this benchmark's

    adjudicator = Adjudicator(
        swarm=StaticSwarm(entry.node, nodes), pipeline=entry.engine.pipeline, propose=propose
    )
    for sent in evidence:
        began = time.perf_counter()
        verdicts.append(await adjudicator.judge(Evidence.from_json(sent.to_json())))
        seconds.append(time.perf_counter() - began)
    return verdicts, seconds


@dataclass
class LiarRun:
    """A detection run: per checked request, whether it named the liar and
    whether the liar lied in it; the leader's verdicts on some evidence."""

    probability: float
    caught: list[bool] = field(default_factory=list)
    lied: list[bool] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    wrongly_accused: int = 0
    verdicts: list[bool | None] = field(default_factory=list)
    adjudication_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


async def liar_run(
    entry: Node,
    shards: Sequence[ShardBackend],
    probability: float,
    requests: int,
    seed: int,
    check_log: CheckLog,
) -> LiarRun:
    """``requests`` requests served by a chain whose middle hop lies on each
    forward with ``probability``, every one checked on the honest replicas;
    then the leader judges the first ``ADJUDICATE`` pieces of evidence."""
    began = time.perf_counter()
    liar = LyingShard(shards[LIAR_HOP], probability, seed)
    run = LiarRun(probability)
    reported: list[Evidence] = []
    kept: list[Evidence] = []
    rng = np.random.default_rng([seed, 99])
    label = "always" if probability >= 1 else f"p={probability:g}"
    async with trio.open_nursery() as nursery:
        chains = await _replicas(nursery, shards, "fp32", liar)
        served = chains[0]
        nodes = [node for chain in chains for node in chain]
        liar_id = served[LIAR_HOP].node
        chain = [n.as_hop() for n in served]
        for i in range(requests):
            # A checker per request: p_detect is what one checked request
            # finds; an entry reports a node once per episode, so a checker
            # kept across requests would stay quiet after its first report.
            checker = _checker(entry, nodes, reported)
            lies = liar.lies
            prompt, params = _request(rng, i, shards[-1].vocab_size)
            result = await serve_and_check(
                entry.engine.pipeline,
                checker,
                reported,
                check_log,
                chain,
                nodes,
                prompt,
                replace(params, max_tokens=DETECT_TOKENS),
                _seed(rng),
            )
            run.lied.append(liar.lies > lies)
            run.caught.append(any(e.accused == liar_id for e in result.evidence))
            run.wrongly_accused += sum(e.accused != liar_id for e in result.evidence)
            run.kinds.update(result.divergences)
            kept += [e for e in result.evidence if e.accused == liar_id]
            if (i + 1) % 25 == 0 or i + 1 == requests:
                say(
                    f"  liar {label}: {i + 1}/{requests} checked, "
                    f"caught {sum(run.caught)}, lied in {sum(run.lied)}"
                )
        run.verdicts, run.adjudication_s = await adjudicate(entry, nodes, kept[:ADJUDICATE])
        nursery.cancel_scope.cancel()
    run.wall_s = time.perf_counter() - began
    return run


# --- detection arithmetic ----------------------------------------------------------


def p99_requests(p: float) -> int | None:
    """The p99 of requests until detection when each request catches the
    liar with probability ``p`` independently (geometric): the least n with
    1 - (1 - p)^n >= 0.99. None: never (p = 0)."""
    if p <= 0:
        return None
    if p >= 1:
        return 1
    return math.ceil(math.log(1 - P99) / math.log1p(-p))


def monte_carlo(caught: Sequence[bool], fraction: float, trials: int, seed: int) -> dict[str, Any]:
    """Simulate the process itself: each trial serves requests until the
    liar is caught; a request is checked with probability ``fraction``, and
    a checked one catches the liar as a measured checked request drawn at
    random did. Quantiles of the requests served (the catching one
    included); None when some trial ran past MONTE_CARLO_CAP."""
    outcomes = np.asarray(caught, dtype=bool)
    if fraction <= 0 or not outcomes.any():
        return {"trials": trials, "p50": None, "p99": None, "mean": None}
    rng = np.random.default_rng(seed)
    until = np.zeros(trials, dtype=np.int64)
    alive = np.arange(trials)
    served = 0
    while alive.size and served < MONTE_CARLO_CAP:
        served += 1
        checked = rng.random(alive.size) < fraction
        drawn = outcomes[rng.integers(0, outcomes.size, alive.size)]
        done = checked & drawn
        until[alive[done]] = served
        alive = alive[~done]
    if alive.size:
        return {"trials": trials, "p50": None, "p99": None, "mean": None}
    return {
        "trials": trials,
        "p50": int(np.quantile(until, 0.5, method="inverted_cdf")),
        "p99": int(np.quantile(until, P99, method="inverted_cdf")),
        "mean": round(float(until.mean()), 2),
    }


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion (sound at 0 and at n)."""
    if n == 0:
        return (0.0, 1.0)
    phat = successes / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def detection(run: LiarRun, fraction: float, trials: int, seed: int) -> dict[str, Any]:
    checked = len(run.caught)
    caught = sum(run.caught)
    p_detect = caught / checked if checked else 0.0
    low, high = wilson(caught, checked)
    lied = sum(run.lied)
    caught_when_lied = sum(c for c, lie in zip(run.caught, run.lied, strict=True) if lie)
    return {
        "lie_probability_per_forward": run.probability,
        "tokens_per_request": DETECT_TOKENS,
        "checked_requests": checked,
        "caught": caught,
        "p_detect": round(p_detect, 4),
        "p_detect_95ci": [round(low, 4), round(high, 4)],
        "requests_lied_in": lied,
        "p_detect_given_lied": round(caught_when_lied / lied, 4) if lied else None,
        "caught_without_a_lie": sum(
            c and not lie for c, lie in zip(run.caught, run.lied, strict=True)
        ),
        "wrongly_accused": run.wrongly_accused,
        "divergence_kinds": dict(run.kinds),
        "verify_fraction": fraction,
        "p_per_request": round(fraction * p_detect, 5),
        "p99_requests": p99_requests(fraction * p_detect),
        "p99_requests_95ci": [p99_requests(fraction * high), p99_requests(fraction * low)],
        "monte_carlo": monte_carlo(run.caught, fraction, trials, seed),
        "quarantine": {
            "adjudicated": len(run.verdicts),
            "guilty": sum(v is True for v in run.verdicts),
            "false_report": sum(v is False for v in run.verdicts),
            "no_verdict": sum(v is None for v in run.verdicts),
            "adjudication_s": [round(s, 4) for s in run.adjudication_s],
            "extra_requests": 0,
        },
        "wall_s": round(run.wall_s, 1),
    }


# --- sketch cost and a realistic shard's overhead ----------------------------------


def _spans(layers: int, hops: int) -> list[tuple[int, int]]:
    cuts = [round(i * layers / hops) for i in range(hops + 1)]
    return list(itertools.pairwise(cuts))


_NO_ROWS: Final = np.zeros((0, SKETCH_DIMS), np.float32)
"""The first hop's input sketch: it commits its token ids by digest."""
LARGE_PROMPT: Final = 16
"""Prompt positions before the timed decode steps on the wide model."""
TIMING_REPEATS: Final = 3
"""Replays of the history timed per shard (the median kept): one prefill
is a single sample on a shared 2-core machine."""


def _timed_steps(
    shard: ShardBackend,
    span: tuple[int, int],
    inputs: np.ndarray,
    cache: KVCache,
    session_seed: int,
    identity: Identity,
    steps: int,
) -> dict[str, list[float]]:
    """Each decode step's forward, then the commitment a hop makes for it
    (sketches, the hash chain's digest, a signature every SIGN_EVERY steps),
    timed apart: seconds per step under `forward`, `sketch`, `commit` (the
    sketches and the digest) and `sign`."""
    times: dict[str, list[float]] = {"forward": [], "sketch": [], "commit": [], "sign": []}
    previous = b""
    for step in range(steps):
        pos = LARGE_PROMPT + step
        row = inputs[pos : pos + 1]
        t0 = time.perf_counter()
        output = shard.forward(row, np.array([pos], dtype=np.int64), cache)
        t1 = time.perf_counter()
        committed_in = _NO_ROWS if shard.is_first else sketch(row, session_seed)
        committed_out = sketch(output[-1:], session_seed)
        t2 = time.perf_counter()
        commitment = Commitment(
            hop=identity.node_id,
            entry=identity.node_id,
            session="ab" * 16,
            model=MODEL,
            layers=span,
            sketch_seed=session_seed,
            step=step,
            pos=pos,
            count=1,
            inputs_digest=ids_digest(row) if shard.is_first else b"",
            inputs=committed_in,
            outputs=committed_out,
            token=0 if shard.is_last else None,
            previous=previous,
        )
        previous = commitment.digest()
        t3 = time.perf_counter()
        if step % SIGN_EVERY == 0:  # as a hop signs its hash chain
            commitment = commitment.signed(identity)
            times["sign"].append(time.perf_counter() - t3)
        times["forward"].append(t1 - t0)
        times["sketch"].append(t2 - t1)
        times["commit"].append(t3 - t1)
    return times


def _wide_hop(
    shard: ShardBackend,
    span: tuple[int, int],
    rng: np.random.Generator,
    identity: Identity,
    steps: int,
    served_tokens: int,
) -> tuple[dict[str, Any], float, float]:
    """One shard of the wide model: its figures, and the seconds its share of
    the request took as served and as one replay prefill of the history."""
    total = LARGE_PROMPT + steps
    if shard.is_first:
        inputs = rng.integers(0, shard.vocab_size, total).astype(np.int64)
    else:
        inputs = rng.standard_normal((total, shard.hidden_size)).astype(np.float32)
    session_seed = _seed(rng)  # one per session, as a hop's: its projection is cached
    shard.forward(inputs[:2], np.arange(2, dtype=np.int64), shard.new_cache())  # warm-up
    cache = shard.new_cache()
    t0 = time.perf_counter()
    shard.forward(inputs[:LARGE_PROMPT], np.arange(LARGE_PROMPT, dtype=np.int64), cache)
    prefill = time.perf_counter() - t0
    times = _timed_steps(shard, span, inputs, cache, session_seed, identity, steps)
    history = LARGE_PROMPT + served_tokens - 1
    replays = []
    for _ in range(TIMING_REPEATS):
        t0 = time.perf_counter()
        shard.forward(inputs[:history], np.arange(history, dtype=np.int64), shard.new_cache())
        replays.append(time.perf_counter() - t0)
    forward_s, commit_s, sign_s = times["forward"], times["commit"], times["sign"]
    served = prefill + sum(forward_s[: served_tokens - 1])
    replay = statistics.median(replays)
    forward_med = statistics.median(forward_s)
    commit_med = statistics.median(commit_s)
    # Per step: the sketches and the chain's digest, and a signature's
    # share (one in SIGN_EVERY); medians, so a step descheduled on a
    # shared machine does not count as the commitment's cost.
    per_step = commit_med + statistics.median(sign_s) / SIGN_EVERY
    hop = {
        "layers": list(span),
        "decode_forward_ms_median": round(forward_med * 1e3, 3),
        "commitment_ms_median": round(commit_med * 1e3, 4),
        "of_which_sketch_ms_median": round(statistics.median(times["sketch"]) * 1e3, 4),
        "signature_ms_median": round(statistics.median(sign_s) * 1e3, 4),
        "commitment_fraction": round(per_step / forward_med, 5),
        "commitment_fraction_mean": round(sum(commit_s) / sum(forward_s), 5),
        "request_served_ms": round(served * 1e3, 2),
        "replay_prefill_ms": round(replay * 1e3, 2),
    }
    return hop, served, replay


def wide_model(root: Path, counts: Counts, seed: int) -> dict[str, Any]:
    """Decode steps on every shard of a wide model: each forward timed
    against the commitment a hop makes for it (sketches, the hash chain's
    digest, and a signature every SIGN_EVERY steps, as
    `HopServer._compute_step`: the figure is the mean over the steps, the
    signatures' cost spread over them); and the request's compute as served
    (prefill of the prompt, then decode steps) against one replay prefill
    of its history."""
    began = time.perf_counter()
    model_dir = make_tiny_model(
        root / "wide",
        layers=counts.sketch_layers,
        hidden_size=counts.sketch_hidden,
        intermediate_size=counts.sketch_intermediate,
        with_manifest=False,
    )
    rng = np.random.default_rng(seed)
    identity = Identity.generate()
    hops: list[dict[str, Any]] = []
    served_s = replay_s = 0.0
    steps = counts.sketch_steps
    served_tokens = min(DETECT_TOKENS, steps)
    for span in _spans(counts.sketch_layers, len(SPANS)):
        shard = load_shard(ShardSpec(model_dir, span[0], span[1], "fp32"), BACKEND)
        hop, served, replay = _wide_hop(shard, span, rng, identity, steps, served_tokens)
        served_s += served
        replay_s += replay
        hops.append(hop)
        say(f"  wide model hop {span}: {json.dumps(hop)}")
        del shard
    return {
        "model": {
            "layers": counts.sketch_layers,
            "hidden": counts.sketch_hidden,
            "intermediate": counts.sketch_intermediate,
            "recipe": "fp32",
            "backend": BACKEND,
        },
        "decode_steps_per_hop": steps,
        "hops": hops,
        "sketch_cost_fraction": max(h["commitment_fraction"] for h in hops),
        "request": {"prompt": LARGE_PROMPT, "tokens": served_tokens},
        "replay_over_served": round(replay_s / served_s, 5),
        "wall_s": round(time.perf_counter() - began, 1),
    }


# --- the run -----------------------------------------------------------------------


def _load(model_dir: Path, span: tuple[int, int], recipe: str) -> ShardBackend:
    shard = load_shard(ShardSpec(model_dir, span[0], span[1], recipe), BACKEND)
    inputs = np.zeros(1, np.int64) if shard.is_first else np.zeros((1, shard.hidden_size), "f4")
    shard.forward(inputs, np.zeros(1, np.int64), shard.new_cache())  # warm-up
    return shard


async def swarm_runs(
    model_dir: Path, counts: Counts, seed: int, check_log: CheckLog
) -> tuple[LiarRun, LiarRun, list[HonestRun]]:
    """The detection runs, then the honest ones, on one entry."""
    shards = {r: [_load(model_dir, span, r) for span in SPANS] for r in RECIPES}
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery)
        fp32 = shards["fp32"]
        say(f"liar, always: {counts.always_requests} checked requests ...")
        always = await liar_run(entry, fp32, 1.0, counts.always_requests, seed, check_log)
        say(f"liar, 1% of forwards: {counts.one_percent_requests} checked requests ...")
        one = await liar_run(
            entry, fp32, ONE_PERCENT, counts.one_percent_requests, seed + 1, check_log
        )
        honest = []
        for i, recipe in enumerate(RECIPES):
            share = counts.honest_requests // len(RECIPES)
            share += i < counts.honest_requests % len(RECIPES)
            say(f"honest, {recipe}: {share} requests, every one checked ...")
            honest.append(await honest_run(entry, shards[recipe], recipe, share, seed, check_log))
        nursery.cancel_scope.cancel()
    return always, one, honest


EXAMPLES: Final = 5
"""Divergence details kept per honest recipe in the JSON."""


def _honest_json(runs: Sequence[HonestRun], fraction: float) -> dict[str, Any]:
    served = [r for run in runs for r in run.served]
    verdicts = [v for run in runs for v in run.verdicts]
    served_us = sum(r.served_us for r in served)
    replay_us = sum(r.replay_us for r in served)
    served_wall = sum(r.served_wall_s for r in served)
    check_wall = sum(r.check_wall_s for r in served)
    kinds: Counter[str] = Counter()
    counters: Counter[str] = Counter()
    for r in served:
        kinds.update(r.divergences)
        counters.update(r.counters)
    sampled = [r for r in served if r.transcript.sampling.temperature > 0]
    return {
        "requests": len(served),
        "checked": counters["checked"],
        "sampled_requests": len(sampled),
        "tokens_per_request": HONEST_TOKENS,
        "divergences": sum(kinds.values()),
        "divergence_kinds": dict(kinds),
        "divergent_requests_sampled": sum(bool(r.divergences) for r in sampled),
        "divergent_requests_greedy": sum(
            bool(r.divergences) for r in served if r.transcript.sampling.temperature == 0
        ),
        "reported": counters["reported"],
        "adjudicated": len(verdicts),
        "adjudicated_guilty": sum(v is True for v in verdicts),
        "examples": [d for r in served for d in r.details][:EXAMPLES],
        "served_compute_s": round(served_us / 1e6, 3),
        "replay_compute_s": round(replay_us / 1e6, 3),
        "replay_over_served_compute": round(replay_us / served_us, 5) if served_us else None,
        "served_wall_s": round(served_wall, 2),
        "check_wall_s": round(check_wall, 2),
        "replay_over_served_wall": round(check_wall / served_wall, 5) if served_wall else None,
        "overhead_fraction": round(fraction * replay_us / served_us, 5) if served_us else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print only the JSON object (progress still on stderr)"
    )
    parser.add_argument("--quick", action="store_true", help="small counts (the test's mode)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    result = run(QUICK if args.quick else FULL, args.seed, quick=args.quick)
    if not args.json:
        for name in TARGETS:
            met = "met" if result["targets_met"][name] else "NOT met"
            say(f"{name}: {result[name]} (target <= {TARGETS[name]}: {met})")
    print(json.dumps(result))
    return 0


def _measure(
    counts: Counts, seed: int
) -> tuple[dict[str, Any], LiarRun, LiarRun, list[HonestRun], float]:
    """The wide model, then the swarm's runs: (wide model's figures, the
    always liar, the 1% liar, the honest runs, the swarm's wall seconds).
    Torch computes on ``COMPUTE_THREADS`` threads meanwhile (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(COMPUTE_THREADS)
    check_log = CheckLog()
    logger = logging.getLogger(CHECK_LOGGER)
    logger.addHandler(check_log)
    try:
        with tempfile.TemporaryDirectory(prefix="shardmesh-verify-") as tmp:
            root = Path(tmp)
            say(f"sketch cost: wide model, hidden {counts.sketch_hidden} ...")
            wide = wide_model(root, counts, seed)
            model_dir = make_tiny_model(root / MODEL, layers=LAYERS, name=MODEL)
            t0 = time.perf_counter()
            always, one, honest = trio.run(swarm_runs, model_dir, counts, seed, check_log)
            swarm_wall = time.perf_counter() - t0
    finally:
        logger.removeHandler(check_log)
        torch.set_num_threads(threads)
    return wide, always, one, honest, swarm_wall


def _anchors(p_always: float, p_one: float) -> dict[str, Any]:
    """Petals (no verification) and BOINC-style redundancy, in our figures."""
    return {
        "petals": {
            "detect_requests_p99_always": None,
            "detect_requests_p99_one_percent": None,
            "verify_overhead_fraction": 0.0,
            "note": "no verification: peers can modify outputs and nothing detects it "
            "(requests until detection: never)",
        },
        "boinc_redundancy": {
            "detect_requests_p99_always": p99_requests(p_always),
            "detect_requests_p99_one_percent": p99_requests(p_one),
            "verify_overhead_fraction": 1.0,
            "note": "every work unit computed twice and compared: a lie is caught on the "
            "first request it is in (fraction 1 with the measured per-request p_detect), "
            "at twice the compute",
        },
    }


_DERIVATION: Final = (
    "each request is checked with probability f = verify_fraction, "
    "independently; a checked request names the liar with probability p_detect "
    "(measured: every request checked); requests until detection N ~ "
    "Geometric(p = f * p_detect), so P(N <= n) = 1 - (1 - p)^n and "
    "p99 = ceil(ln(0.01) / ln(1 - p)); monte_carlo simulates that process, a checked "
    "request's outcome drawn from the measured ones. Quarantine: one adjudication "
    "(the leader's recomputation) after the detecting check, no further request."
)


def _overhead_json(
    fraction: float, overall: dict[str, Any], wide: dict[str, Any]
) -> dict[str, Any]:
    """What checking costs, on the tiny model's swarm and on the wide model."""
    return {
        "verify_fraction": fraction,
        "swarm_tiny_model": {
            k: overall[k]
            for k in (
                "served_compute_s",
                "replay_compute_s",
                "replay_over_served_compute",
                "replay_over_served_wall",
            )
        },
        "wide_model": {
            "replay_over_served": wide["replay_over_served"],
            "overhead_fraction": round(fraction * wide["replay_over_served"], 5),
            "request": wide["request"],
        },
        "note": "compute by the hops' own clocks (ChainTiming compute_us for the served "
        "request, HopStats.prefill_compute_s on the checking hops for the replay); the "
        "wide model's is one shard at a time in this process (prefill of the prompt plus "
        "decode steps, against one prefill of the history)",
    }


def _swarm_json(swarm_wall: float) -> dict[str, Any]:
    """The swarm the detection and honest runs used."""
    return {
        "model": MODEL,
        "layers": LAYERS,
        "spans": [list(s) for s in SPANS],
        "replicas": REPLICAS,
        "liar_hop": LIAR_HOP,
        "noise": NOISE,
        "recipes": list(RECIPES),
        "backend": BACKEND,
        "torch_threads": COMPUTE_THREADS,
        "wall_s": round(swarm_wall, 1),
    }


def run(counts: Counts, seed: int, *, quick: bool = False) -> dict[str, Any]:
    """Every measurement; the benchmark's JSON object. Torch computes on
    ``COMPUTE_THREADS`` threads meanwhile (restored after)."""
    started = time.perf_counter()
    fraction = PlacementSettings().verify_fraction
    wide, always, one, honest, swarm_wall = _measure(counts, seed)
    always_json = detection(always, fraction, counts.monte_carlo_trials, seed)
    one_json = detection(one, fraction, counts.monte_carlo_trials, seed + 1)
    honest_json = {run.recipe: _honest_json([run], fraction) for run in honest}
    overall = _honest_json(honest, fraction)
    figures = {
        "detect_requests_p99_always": always_json["p99_requests"],
        "detect_requests_p99_one_percent": one_json["p99_requests"],
        "false_quarantines": overall["divergences"],
        "verify_overhead_fraction": overall["overhead_fraction"],
        "sketch_cost_fraction": wide["sketch_cost_fraction"],
    }

    def met(name: str) -> bool:
        value = figures[name]
        return value is not None and value <= TARGETS[name]

    p_always = always_json["p_detect"]
    p_one = one_json["p_detect"]
    return {
        "benchmark": "verify",
        "mode": "quick" if quick else "full",
        **figures,
        "detect_requests_p99_always_monte_carlo": always_json["monte_carlo"]["p99"],
        "detect_requests_p99_one_percent_monte_carlo": one_json["monte_carlo"]["p99"],
        "p_detect_always": p_always,
        "p_detect_one_percent": p_one,
        "verify_fraction": fraction,
        "honest_requests": overall["requests"],
        "false_quarantines_adjudicated_guilty": overall["adjudicated_guilty"],
        "verify_overhead_fraction_wide_model": round(fraction * wide["replay_over_served"], 5),
        "targets": TARGETS,
        "targets_met": {name: met(name) for name in TARGETS},
        "anchors": _anchors(p_always, p_one),
        "detection": {"derivation": _DERIVATION, "always": always_json, "one_percent": one_json},
        "honest": {"by_recipe": honest_json, "all": overall},
        "overhead": _overhead_json(fraction, overall, wide),
        "sketch": wide,
        "swarm": _swarm_json(swarm_wall),
        "seed": seed,
        "wall_s": round(time.perf_counter() - started, 1),
    }


if __name__ == "__main__":
    raise SystemExit(main())
