"""Pipeline benchmark: chat through real node processes on loopback, side by
side with the same model decoding in one process, all in one run.

    python -m benchmarks.pipeline [--json] [--tokens N] [--requests N] [--skip-large]
                                  [--skip-real] [--pin]

Three models (the tiny test model, a ~300 M-parameter random one, and the
pretrained SmolLM2-135M), each decoded by transformers in this process (the
anchor, measured around every swarm so drift cancels) and by 1-hop and 3-hop
swarms; the per-hop cost is split into messaging and the compute penalty of
an idling hop, with a control. `slow_hop` runs a 512-token prompt through a
chain with a 20x slower middle hop. `--pin` gives each process cores of its
own. The last line printed is one JSON object; what each key means:
docs/benchmarks.md#pipeline.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

from benchmarks.runtime import transformers_greedy
from mesh.identity import Identity
from mesh.transport import open_planes
from mesh.wire import decode_tensor
from runtime.cli.chat_client import sse_chunks
from runtime.cli.localswarm import LocalSwarm
from runtime.inference import hop_server
from runtime.inference.blame import Receipt, rows_digest
from runtime.inference.chain import ChainHop, PipelineError
from runtime.inference.commitment import Commitment, sketch
from runtime.inference.deadlines import DEFAULT_DEADLINES, Deadlines, HopPace, expected_pace
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import HopServer
from runtime.inference.protocol import encode_message
from runtime.model.backends import load_shard
from runtime.model.backends.base import KVCache, ShardBackend, ShardSpec
from runtime.model.doctor import measure_throughput
from runtime.model.manifest import load_manifest
from runtime.model.pretrained import smollm2_135m
from runtime.model.progress import Progress
from runtime.model.sampling import SamplingParams
from runtime.model.tiny import make_tiny_model

MESSAGES = [{"role": "user", "content": "Tell me about the swarm of volunteers."}]
TARGET_PER_HOP_MS = 0.5
"""Per extra hop per decode step, CURVE on (issue 31 item 5; 0.49 ms before
the planes were encrypted)."""
TARGET_LARGE_3HOP_RATIO = 0.9
TARGET_REAL_3HOP_RATIO = 0.9
"""A 3-hop swarm of the real checkpoint keeps at least this share of
transformers' decode rate in one process (`real_3hop_vs_single`)."""
REAL_THREADS = 1
"""Compute threads per node (and the anchor's) for the real checkpoint
without --pin (`real_model` says why)."""
TARGET_CURVE_RATIO = 0.9
"""A 3-hop decode with CurveZMQ planes keeps at least this share of the same
swarm's speed with plaintext planes (`curve_3hop_decode_ratio`)."""
READY_TIMEOUT_S = 180.0
MODELS = {
    # name: (layers, hidden, intermediate, compute threads per node)
    # The tiny model gains nothing from threads; the large one gets every
    # core, like the single-process anchor: in a chain only one hop
    # computes at a time, so hops do not fight over the cores.
    "tiny": (8, 64, 128, 1),
    "large": (6, 1024, 4096, os.cpu_count() or 1),
}


PIN_GROUPS = 4
"""Core sets under --pin: this process, then one per node of the 3-hop chain."""


def pin_sets(available: Iterable[int], groups: int = PIN_GROUPS) -> list[frozenset[int]]:
    """`available` cores split into `groups` disjoint sets of equal size,
    lowest first (leftover cores go unused, so every set is alike)."""
    cores = sorted(available)
    size = len(cores) // groups
    if size < 1:
        raise ValueError(f"--pin needs at least {groups} cores; this process may use {len(cores)}")
    return [frozenset(cores[i * size : (i + 1) * size]) for i in range(groups)]


def spans(layers: int, hops: int) -> list[tuple[int, int]]:
    cuts = [round(i * layers / hops) for i in range(hops + 1)]
    return list(itertools.pairwise(cuts))


async def _stream_once(client: httpx.AsyncClient, api: str, name: str, tokens: int) -> dict:
    body = {
        "model": name,
        "messages": MESSAGES,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    usage = timing = None
    async with client.stream("POST", f"{api}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"chat failed: {response.status_code} {response.text}")
        async for chunk in sse_chunks(response):
            usage = chunk.get("usage") or usage
            timing = chunk.get("shardmesh", {}).get("timing") or timing  # on the final chunk
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None and usage is not None and timing is not None
    count = usage["completion_tokens"]
    return {
        "ttft_ms": (first - sent) * 1000,
        "decode_tok_s": (count - 1) / (last - first) if last > first else float("nan"),
        "tokens": count,
        "hop_decode_ms": [hop["decode_ms_per_step"] for hop in timing["hops"]],
    }


async def _swarm(
    root: Path,
    model_dir: Path,
    name: str,
    layers: int,
    hops: int,
    threads: int,
    tokens: int,
    requests: int,
    node_cores: Sequence[frozenset[int]] | None,
    curve: bool,
) -> dict[str, Any]:
    env = {"OMP_NUM_THREADS": str(threads)}
    plaintext = [] if curve else ["--insecure-plaintext"]
    async with LocalSwarm(root, profile="local", extra_env=env) as swarm:
        nodes = [
            swarm.new_node(
                args=["--model", str(model_dir), "--layers", f"{a}:{b}", *plaintext],
                cpus=None if node_cores is None else node_cores[i],
            )
            for i, (a, b) in enumerate(spans(layers, hops))
        ]
        await swarm.start_ready(nodes[0], timeout=60)
        await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=60)

        def ready(views: dict[str, Any]) -> bool:
            coverage = (views[nodes[0].name] or {}).get("coverage", {}).get(name)
            return bool(coverage) and not coverage["gaps"] and coverage["layers"] == layers

        await swarm.wait_for(nodes[:1], ready, READY_TIMEOUT_S, f"{name} served")
        async with httpx.AsyncClient(timeout=300) as client:
            await _stream_once(client, nodes[0].api, name, tokens)  # warm-up
            runs = [await _stream_once(client, nodes[0].api, name, tokens) for _ in range(requests)]
        views = await swarm.views(nodes)
    return {
        "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
        "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 2),
        "tokens": runs[0]["tokens"],
        # Each hop's mean decode compute, by its own clock: the median over requests.
        "hop_compute_ms": [
            round(statistics.median(per_hop), 3)
            for per_hop in zip(*(r["hop_decode_ms"] for r in runs), strict=True)
        ],
        # Decode steps that went through a hop's batcher (a worker thread)
        # rather than running at once: 0 when each lone session's step took
        # the immediate path, as it should with one request at a time.
        "batched_steps": sum(_batched_rows(views[node.name]) for node in nodes),
    }


def _batched_rows(view: dict[str, Any] | None) -> int:
    """The rows a node's batcher ran (its status' hop.batching.rows)."""
    hop = (view or {}).get("hop") or {}
    return int((hop.get("batching") or {}).get("rows", 0))


def _single_process(model_dir: Path, tokens: int) -> Callable[[], float]:
    """The anchor, loaded once: each call decodes `tokens` greedily three
    times and returns the best rate (tokens per second)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt = np.asarray(ids, dtype=np.int64)

    def measure() -> float:
        best = float("inf")
        for _ in range(3):
            _tokens, _prefill, decode = transformers_greedy(model, prompt, tokens)
            best = min(best, decode)
        return (tokens - 1) / best

    return measure


def _idle_control(
    model_dir: Path, span: tuple[int, int], threads: int, idle_s: float, steps: int = 40
) -> dict[str, Any]:
    """The middle hop's shard, here in one process with no network at all:
    decode forwards back to back, then each after sleeping as long as a hop
    of the 3-hop chain waits for its next step. The difference is what this
    machine charges a process for idling, whatever the process does."""
    import torch

    from runtime.model.backends import load_shard
    from runtime.model.backends.base import ShardSpec

    shard = load_shard(ShardSpec(model_dir, span[0], span[1], "fp32"), "torch")
    rng = np.random.default_rng(0)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # what a node of the swarm computes with
    try:

        def median_forward_ms(sleep_s: float) -> float:
            cache = shard.new_cache()
            prompt = rng.standard_normal((16, shard.hidden_size), dtype=np.float32)
            shard.forward(prompt, np.arange(16), cache)
            times = []
            for i in range(steps):
                if sleep_s:
                    time.sleep(sleep_s)
                inputs = rng.standard_normal((1, shard.hidden_size), dtype=np.float32)
                began = time.perf_counter()
                shard.forward(inputs, np.array([16 + i]), cache)
                times.append(time.perf_counter() - began)
            return 1000 * statistics.median(times)

        hot = median_forward_ms(0.0)
        after_idle = median_forward_ms(idle_s)
    finally:
        torch.set_num_threads(saved_threads)
    return {
        "span": list(span),
        "idle_ms": round(1000 * idle_s, 3),
        "hot_ms": round(hot, 3),
        "after_idle_ms": round(after_idle, 3),
        "slowdown": round(after_idle / hot, 3),
    }


def real_model(
    root: Path, tokens: int, requests: int, pinned: Sequence[frozenset[int]] | None
) -> dict[str, Any]:
    """The figures of the real checkpoint (fp32), fetched and converted on
    first use; the CURVE control is the large model's business. One compute
    thread per node and for the anchor, unless --pin gives each node cores
    of its own: on a machine whose cores others share, torch's OpenMP
    threads wait on each other at every op (a 2-thread decode of a small
    model measured 60x slower than 1 thread beside one busy process), so
    one thread is what measures the pipeline rather than the neighbours."""
    with Progress("smollm2-135m") as progress:
        folder = smollm2_135m(progress=progress).folder
    threads = REAL_THREADS if pinned is None else len(pinned[1])
    return measure(root, folder, threads, tokens, requests, pinned, False)


def generated(root: Path, name: str) -> Path:
    """One of MODELS, random weights, written under `root`."""
    layers, hidden, intermediate, _threads = MODELS[name]
    return make_tiny_model(
        root / name, layers=layers, name=name, hidden_size=hidden, intermediate_size=intermediate
    )


@dataclass
class _Runs:
    """One model's measurements, in the order they were taken: the anchor's
    rates (before, between and after the swarms), the 1-hop and 3-hop
    swarms, and the plaintext 3-hop swarms around the encrypted one."""

    singles: list[float]
    one: dict[str, Any]
    three: dict[str, Any]
    plain: list[dict[str, Any]]


def _interleaved(
    anchor: Callable[[], float],
    swarm: Callable[[int, bool], dict[str, Any]],
    curve_control: bool,
) -> _Runs:
    """The anchor is measured before, between and after the swarms, and each
    swarm is compared with the two measurements around it: this machine's
    speed drifts within a run, and a ratio of two rates taken a minute apart
    would carry that drift."""
    singles = [anchor()]
    one = swarm(1, True)
    singles.append(anchor())
    # What CURVE costs: the same 3-hop swarm with plaintext planes, run right
    # before and right after the encrypted one and averaged, so the
    # machine's drift during the run cancels as it does for the anchor.
    plain = [swarm(3, False)] if curve_control else []
    three = swarm(3, True)
    plain += [swarm(3, False)] if curve_control else []
    singles.append(anchor())
    return _Runs(singles, one, three, plain)


def measure(
    root: Path,
    model_dir: Path,
    threads: int,
    tokens: int,
    requests: int,
    pinned: Sequence[frozenset[int]] | None = None,
    curve_control: bool = True,
) -> dict[str, Any]:
    """One model's figures; `threads` per node (and for the anchor);
    `pinned` is `pin_sets`' answer under --pin (this process is already on
    the first set), whose node sets then set the threads of any model given
    more than one. `curve_control`: also run the plaintext swarms that
    `curve_3hop_decode_ratio` compares with."""
    manifest = load_manifest(model_dir)
    name, layers = manifest["name"], manifest["num_layers"]
    import torch

    if pinned is not None and threads > 1:  # a model that gains from threads: the node's set
        threads = len(pinned[1])
    torch.set_num_threads(threads)  # the anchor computes as a node does
    anchor = _single_process(model_dir, tokens)

    def swarm(hops: int, curve: bool) -> dict[str, Any]:
        return trio.run(
            _swarm, root / f"{name}-{hops}hop-{'curve' if curve else 'plain'}", model_dir,
            name, layers, hops, threads, tokens, requests,
            None if pinned is None else pinned[1:], curve,
        )  # fmt: skip

    runs = _interleaved(anchor, swarm, curve_control)
    return _figures(model_dir, name, layers, threads, runs, curve_control)


def _figures(
    model_dir: Path, name: str, layers: int, threads: int, runs: _Runs, curve_control: bool
) -> dict[str, Any]:
    """One model's JSON object from its runs (and the idle control, measured
    here from the 3-hop swarm's middle hop)."""
    singles, one, three = runs.singles, runs.one, runs.three
    single = statistics.median(singles)
    single_one = statistics.mean(singles[:2])
    single_three = statistics.mean(singles[1:])
    per_hop = (1000 / three["decode_tok_s"] - 1000 / one["decode_tok_s"]) / 2
    # The same layers run either way, so any difference in their summed
    # compute time is what splitting them cost the shards themselves (a hop
    # idles between its steps; see docs/benchmarks.md), the rest of
    # per_hop is messaging: ZeroMQ, codecs, wake-ups.
    compute_penalty = (sum(three["hop_compute_ms"]) - sum(one["hop_compute_ms"])) / 2
    middle = spans(layers, 3)[1]
    idle_ms = 1000 / three["decode_tok_s"] - three["hop_compute_ms"][1]
    control = _idle_control(model_dir, middle, threads, max(0.0, idle_ms) / 1000)
    config = json.loads((model_dir / "config.json").read_text())
    figures: dict[str, Any] = {
        "model": {
            "name": name,
            "layers": layers,
            "hidden_size": config["hidden_size"],
            "intermediate_size": config["intermediate_size"],
            "threads_per_node": threads,
        },
        "tokens": one["tokens"],
        "single_process_decode_tok_s": round(single, 2),
        "single_process_runs_tok_s": [round(rate, 2) for rate in singles],
        "swarm_1hop_decode_tok_s": one["decode_tok_s"],
        "swarm_3hop_decode_tok_s": three["decode_tok_s"],
        "swarm_1hop_vs_single": round(one["decode_tok_s"] / single_one, 3),
        "swarm_3hop_vs_single": round(three["decode_tok_s"] / single_three, 3),
        "per_hop_overhead_ms": round(per_hop, 3),
        "per_hop_compute_penalty_ms": round(compute_penalty, 3),
        "per_hop_messaging_ms": round(per_hop - compute_penalty, 3),
        "batched_steps": {"1hop": one["batched_steps"], "3hop": three["batched_steps"]},
        "hop_compute_ms_1hop": one["hop_compute_ms"],
        "hop_compute_ms_3hop": three["hop_compute_ms"],
        "idle_control": control,
        "single_process_step_ms": round(1000 / single, 3),
        "ttft_ms": three["ttft_ms"],
        "ttft_1hop_ms": one["ttft_ms"],
    }
    if curve_control:
        plain_rate = statistics.mean(run["decode_tok_s"] for run in runs.plain)
        figures["curve_3hop_decode_ratio"] = round(three["decode_tok_s"] / plain_rate, 3)
        figures["curve"] = {
            "true": {k: three[k] for k in ("decode_tok_s", "ttft_ms")},
            "false": {k: [run[k] for run in runs.plain] for k in ("decode_tok_s", "ttft_ms")},
        }
    return figures


SLOW_HOP_PROMPT_TOKENS = 512
SLOW_HOP_FACTOR = 20
FAST_HOP_S_PER_TOKEN = 0.001
"""The emulated speed of the chain's other hops: 1000 positions a second
through their span, a prefill on a modest GPU; the slow hop takes
`SLOW_HOP_FACTOR` times as long (50 a second, an MLX hop on a laptop CPU)."""
SLOW_HOP_NEW_TOKENS = 16
SLOW_HOP_SEED = 7
LOOPBACK = "tcp://127.0.0.1:0"

FIXED_PREFILL_BASE_S = 2.0
FIXED_PREFILL_PER_TOKEN_S = 0.005
"""The entry's timeouts before issue 15: 2 s + 5 ms per token for a prefill
(and 2 s for a decode step), whatever the hops' speed."""


class PacedShard:
    """A real shard made slower: its forward, then `s_per_token` seconds
    of sleep per position computed. Emulates a slower machine in one
    process (the sleep releases the GIL, like a device computing)."""

    def __init__(self, shard: ShardBackend, s_per_token: float) -> None:
        self.shard = shard
        self.s_per_token = s_per_token
        self.name = shard.name
        self.device = shard.device
        self.spec = shard.spec
        self.num_layers = shard.num_layers
        self.hidden_size = shard.hidden_size
        self.vocab_size = shard.vocab_size

    @property
    def is_first(self) -> bool:
        return self.shard.is_first

    @property
    def is_last(self) -> bool:
        return self.shard.is_last

    def new_cache(self) -> KVCache:
        return self.shard.new_cache()

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        out = self.shard.forward(inputs, positions, cache)
        time.sleep(self.s_per_token * len(positions))
        return out

    def forward_batch(
        self, steps: Sequence[tuple[np.ndarray, np.ndarray, KVCache]]
    ) -> list[np.ndarray]:
        """The batch, then the sleep of its positions computed one by one."""
        outs = self.shard.forward_batch(steps)
        time.sleep(self.s_per_token * sum(len(positions) for _, positions, _ in steps))
        return outs

    def info(self) -> dict[str, Any]:
        return {**self.shard.info(), "s_per_token": self.s_per_token}


def measured_pace(shard: ShardBackend) -> tuple[HopPace, dict[str, float]]:
    """What an entry expects of a node with this shard before it has
    observed it: the pace its capability report (the doctor's measurement)
    gives, and the measured rates."""
    throughput = measure_throughput(shard)
    pace = expected_pace(
        claimed_prefill_tokens_per_s=throughput.prefill_tok_s,
        claimed_decode_tokens_per_s=throughput.decode_tok_s,
    )
    rates = {"prefill_tok_s": throughput.prefill_tok_s, "decode_tok_s": throughput.decode_tok_s}
    return pace, {k: round(v, 1) for k, v in rates.items()}


def fixed_timeouts(chain: Sequence[ChainHop]) -> tuple[list[ChainHop], Deadlines]:
    """The fixed timeouts the entry had before issue 15, as the deadline
    rule: factor 1 on a 2 s floor, every hop expected to take its share of
    5 ms per prompt token and nothing per decode step, so a prefill of T
    tokens gets 2 + 0.005 T seconds and a decode step 2 s, whatever the hops."""
    share = HopPace(FIXED_PREFILL_PER_TOKEN_S / len(chain), 0.0)
    deadlines = Deadlines(floor_s=FIXED_PREFILL_BASE_S, factor=1.0)
    return [replace(hop, pace=share) for hop in chain], deadlines


async def serve_engine(
    shard: ShardBackend | None,
    model: str,
    *,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One node in this process: its planes on loopback, its engine, and a
    hop server when it holds a shard; runs until cancelled."""
    drops: Counter[str] = Counter()
    identity = Identity.generate()
    async with open_planes(LOOPBACK, LOOPBACK, drops=drops, keys=identity.plane_keys()) as (
        _control,
        data,
    ):
        hop = None
        if shard is not None:
            hop = HopServer(data, shard, model=model, drops=drops, signer=identity)
        engine = Engine(data, drops=drops, signer=identity, hop_server=hop)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            task_status.started(engine)


async def _generate(
    entry: Engine,
    model: str,
    chain: Sequence[ChainHop],
    prompt: Sequence[int],
    deadlines: Deadlines,
) -> dict[str, Any]:
    """One greedy generation, timed by this process's clock."""
    params = SamplingParams(temperature=0.0, max_tokens=SLOW_HOP_NEW_TOKENS)
    began = time.perf_counter()
    got: list[float] = []
    error = None
    stream = entry.pipeline.generate(
        model, chain, prompt, params, seed=SLOW_HOP_SEED, deadlines=deadlines
    )
    try:
        async with aclosing(stream) as tokens:
            async for _token in tokens:
                got.append(time.perf_counter() - began)
    except PipelineError as exc:
        error = str(exc)
    return {
        "completed": error is None and len(got) == SLOW_HOP_NEW_TOKENS,
        "tokens": len(got),
        "ttft_s": round(got[0], 3) if got else None,
        "decode_tok_s": round((len(got) - 1) / (got[-1] - got[0]), 2) if len(got) > 1 else None,
        "ended_after_s": round(time.perf_counter() - began, 3),
        "error": error,
    }


async def _slow_hop(model_dir: Path, model: str) -> dict[str, Any]:
    layers = MODELS["tiny"][0]
    paced = [FAST_HOP_S_PER_TOKEN, FAST_HOP_S_PER_TOKEN * SLOW_HOP_FACTOR, FAST_HOP_S_PER_TOKEN]
    shards = [
        PacedShard(load_shard(ShardSpec(model_dir, a, b, "fp32"), "torch"), s_per_token)
        for (a, b), s_per_token in zip(spans(layers, len(paced)), paced, strict=True)
    ]
    measured = [measured_pace(shard) for shard in shards]
    rng = np.random.default_rng(SLOW_HOP_SEED)
    prompt = rng.integers(0, shards[0].vocab_size, SLOW_HOP_PROMPT_TOKENS).tolist()
    async with trio.open_nursery() as nursery:
        entry: Engine = await nursery.start(serve_engine, None, model)
        chain = []
        for shard, (pace, _rates) in zip(shards, measured, strict=True):
            node: Engine = await nursery.start(serve_engine, shard, model)
            node_id = node.plane.keys.node_id.hex()
            span = (shard.spec.start, shard.spec.end)
            chain.append(ChainHop(node_id, node.plane.address, span, pace))
        expected = [hop.pace.step_s(len(prompt), prefill=True) for hop in chain]
        run = await _generate(entry, model, chain, prompt, DEFAULT_DEADLINES)
        fixed_chain, fixed = fixed_timeouts(chain)
        before = await _generate(entry, model, fixed_chain, prompt, fixed)
        nursery.cancel_scope.cancel()
    rates = [r for _pace, r in measured]
    return {
        "prompt_tokens": len(prompt),
        "new_tokens": SLOW_HOP_NEW_TOKENS,
        "emulated_s_per_token": paced,
        "measured": rates,
        "measured_prefill_slowdown": round(
            rates[0]["prefill_tok_s"] / rates[1]["prefill_tok_s"], 1
        ),
        "expected_prefill_s": [round(e, 3) for e in expected],
        "prefill_deadline_s": round(DEFAULT_DEADLINES.step_s(expected), 3),
        **run,
        "fixed_timeouts": {
            "prefill_deadline_s": round(
                FIXED_PREFILL_BASE_S + FIXED_PREFILL_PER_TOKEN_S * len(prompt), 3
            ),
            **before,
        },
    }


def slow_hop(root: Path) -> dict[str, Any]:
    """The `slow_hop` scenario (docs/benchmarks.md#pipeline), its shards
    computing with the tiny model's threads, like a node of the swarm."""
    import torch

    layers, hidden, intermediate, threads = MODELS["tiny"]
    model_dir = make_tiny_model(
        root / "slow-hop",
        layers=layers,
        name="tiny",
        hidden_size=hidden,
        intermediate_size=intermediate,
    )
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return trio.run(_slow_hop, model_dir, "tiny")
    finally:
        torch.set_num_threads(saved_threads)


PARTS_ROUNDS = 400
"""Calls per part in `hop_parts` (each timed alone, the median kept)."""
ECHO_ROUNDS = 1000
"""Round trips of a forward between two processes in `hop_parts`."""


def _median_us(fn: Callable[[], object], rounds: int = PARTS_ROUNDS) -> float:
    """The median CPU time of one call of ``fn`` in this thread, in us."""
    for _ in range(rounds // 10):
        fn()
    times = []
    for _ in range(rounds):
        began = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - began)
    return round(statistics.median(times) / 1000, 1)


def _forward_fixed_us(model_dir: Path, layers: int) -> float:
    """What splitting a decode step's forward over three shards adds to it
    in one process, back to back (per extra hop): the shard's fixed cost
    per call (inputs to tensors, masks, rotary tables), no idling."""
    rng = np.random.default_rng(0)

    def decode_us(span: tuple[int, int]) -> float:
        shard = load_shard(ShardSpec(model_dir, span[0], span[1], "fp32"), "torch")
        cache = shard.new_cache()
        width = shard.hidden_size

        def inputs(count: int) -> np.ndarray:
            if shard.is_first:
                return np.full(count, 7, dtype=np.int64)
            return rng.standard_normal((count, width), dtype=np.float32)

        shard.forward(inputs(16), np.arange(16), cache)
        at = itertools.count(16)
        return _median_us(lambda: shard.forward(inputs(1), np.array([next(at)]), cache), 200)

    import torch

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a tiny model's node computes
    try:
        whole = decode_us((0, layers))
        split = sum(decode_us(span) for span in spans(layers, 3))
    finally:
        torch.set_num_threads(saved_threads)
    return round((split - whole) / 2, 1)


def _echo() -> None:
    """The far end of `hop_parts`' round trips (a child process): prints its
    plane's address and id, reads the other's, and sends back whatever
    comes."""

    async def serve() -> None:
        identity = Identity.generate()
        keys = identity.plane_keys()
        async with open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=keys) as (_c, data):
            print(data.address, identity.node_id.hex(), flush=True)
            address, node = (await trio.to_thread.run_sync(sys.stdin.readline)).split()
            while True:
                _peer, frames = await data.receive()
                data.send(address, frames, peer=bytes.fromhex(node))

    trio.run(serve)


async def _round_trips(frames: list[Any]) -> tuple[float, float]:
    """Half the median round trip of ``frames`` to an echoing child process
    over CURVE planes (wall clock: libzmq's I/O threads, loopback TCP and
    both processes' wake-ups), and the sender's CPU in `Plane.send`."""
    code = "from benchmarks.pipeline import _echo; _echo()"
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await child.stdout.receive_some(256)
        address, node = line.decode().split()
        identity = Identity.generate()
        keys = identity.plane_keys()
        async with open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=keys) as (_c, data):
            await child.stdin.send_all(f"{data.address} {identity.node_id.hex()}\n".encode())
            trips, sends = [], []
            for i in range(ECHO_ROUNDS + ECHO_ROUNDS // 10):
                began, cpu = time.perf_counter_ns(), time.thread_time_ns()
                data.send(address, frames, peer=bytes.fromhex(node))
                sent = time.thread_time_ns() - cpu
                await data.receive()
                if i >= ECHO_ROUNDS // 10:
                    trips.append(time.perf_counter_ns() - began)
                    sends.append(sent)
    finally:
        child.kill()
        await child.wait()
    return statistics.median(trips) / 2000, statistics.median(sends) / 1000


def hop_parts(model_dir: Path, layers: int) -> dict[str, float]:
    """Each part of a middle hop's decode step, measured apart with the real
    functions on a step's real sizes (the tiny model: one row of its
    hidden size), in us: CPU time in this thread, except ``transit``, a
    one-way trip between two processes (wall clock). What each key is:
    docs/benchmarks.md#pipeline."""
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((1, hidden), dtype=np.float32)
    sender, entry = Identity.generate(), Identity.generate().node_id

    def commitment() -> Commitment:
        return Commitment(
            hop=sender.node_id, entry=entry, session="0" * 32, model="tiny", layers=(0, 3),
            sketch_seed=5, step=9, pos=16, count=1, inputs_digest=bytes(16),
            inputs=sketch(rows, 5), outputs=sketch(rows, 5), token=None, previous=bytes(32),
        )  # fmt: skip

    sent = commitment()
    receipt = Receipt.of(sent, rows_digest(rows)).signed(sender)
    header = {
        "op": "forward", "session": "1" * 32, "step": 9, "pos": 16, "compute_us": [900],
        "handoff": hop_server._handoff_header(sent, receipt.signature),
    }  # fmt: skip
    frames = encode_message(header, rows)
    wire = [bytes(frame) for frame in frames]
    decoded = decode_tensor(wire)[0]
    session: Any = type("Session", (), {"prev": sender.node_id, "entry": entry})()
    step = hop_server._Step(9, 16, rows, (900,), (sent, receipt.signature))

    def parse() -> object:
        return hop_server._handoff(session, "tiny", decoded, 9, 16, 1)

    def sign() -> object:  # the commitment's digest is `commitment`'s, kept
        return Receipt.of(sent, rows_digest(rows)).signed(sender)

    transit, send = trio.run(_round_trips, frames)
    return {
        "transit": round(transit, 1),
        "decode": _median_us(lambda: decode_tensor(wire)),
        "handoff_parse": _median_us(parse),
        "handoff_check": _median_us(lambda: hop_server._received(step)),
        "receipt_verify": _median_us(receipt.verified),
        "forward_fixed": _forward_fixed_us(model_dir, layers),
        "commitment": _median_us(lambda: commitment().digest()),
        "receipt_sign": _median_us(sign),
        "encode": _median_us(lambda: encode_message(header, rows)),
        "send": round(send, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--requests", type=int, default=5, help="measured requests (default 5)")
    parser.add_argument("--skip-large", action="store_true", help="without the large model")
    parser.add_argument(
        "--skip-real", action="store_true", help="without the real checkpoint (SmolLM2-135M)"
    )
    parser.add_argument(
        "--pin", action="store_true", help="give this process and each node cores of its own"
    )
    args = parser.parse_args(argv)
    if args.tokens < 4 or args.requests < 1:
        parser.error("--tokens must be >= 4 and --requests >= 1")
    pinned = None
    if args.pin:
        if not hasattr(os, "sched_setaffinity"):
            parser.error("--pin needs Linux (os.sched_setaffinity)")
        try:
            pinned = pin_sets(os.sched_getaffinity(0))
        except ValueError as exc:
            parser.error(str(exc))
        os.sched_setaffinity(0, pinned[0])
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardmesh-pipeline-") as tmp:
        root = Path(tmp)

        def generated_model(name: str) -> dict[str, Any]:
            threads = MODELS[name][3]
            model = generated(root, name)
            return measure(root, model, threads, args.tokens, args.requests, pinned)

        tiny = generated_model("tiny")
        parts = hop_parts(generated(root, "tiny"), MODELS["tiny"][0])
        large = None if args.skip_large else generated_model("large")
        real = None if args.skip_real else real_model(root, args.tokens, args.requests, pinned)
        slow = slow_hop(root)
    result: dict[str, Any] = {
        "benchmark": "pipeline",
        "slow_hop_512_completed": slow["completed"],
        "slow_hop": slow,
        "real_3hop_vs_single": None if real is None else real["swarm_3hop_vs_single"],
        "target_real_3hop_vs_single": TARGET_REAL_3HOP_RATIO,
        "real": real,
        **{k: v for k, v in tiny.items() if k != "model"},
        "tiny_model": tiny["model"],
        "hop_parts_us": parts,
        "large": large,
        "pinned_cores": None if pinned is None else [sorted(cores) for cores in pinned],
        "target_per_hop_overhead_ms": TARGET_PER_HOP_MS,
        "meets_per_hop_target": tiny["per_hop_overhead_ms"] <= TARGET_PER_HOP_MS,
        "target_large_3hop_vs_single": TARGET_LARGE_3HOP_RATIO,
        "meets_large_target": None
        if large is None
        else large["swarm_3hop_vs_single"] >= TARGET_LARGE_3HOP_RATIO,
        "target_curve_3hop_decode_ratio": TARGET_CURVE_RATIO,
        "meets_curve_target": all(
            m["curve_3hop_decode_ratio"] >= TARGET_CURVE_RATIO for m in (tiny, large) if m
        ),
        "wall_s": round(time.perf_counter() - began, 1),
    }
    if not args.json:
        print(
            f"tiny: per-hop overhead {tiny['per_hop_overhead_ms']} ms, "
            f"3-hop {tiny['swarm_3hop_decode_tok_s']} tok/s vs single "
            f"{tiny['single_process_decode_tok_s']}",
            file=sys.stderr,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
