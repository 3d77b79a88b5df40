"""Concurrency benchmark (issue 31): many streams at once through a chain, and the ceiling.

    python -m benchmarks.concurrency [--json] [--streams 1,4,16] [--tokens N]
                                     [--hops N] [--layers N] [--hidden N]

A skeleton of the issue's benchmark, in one process: an entry and `--hops`
hops (real engines on loopback planes, torch shards of a random model of
real proportions) serve `--streams` greedy generations at once, each with
its own prompt; per count it reports the aggregate tokens per second, the
inter-token times' p50 and p99, and each hop's batch counters. Beside them,
transformers' batched `generate` of the whole model in this process at the
same batch sizes (the ceiling). Not yet the issue's full run: no separate
node processes, no pretrained checkpoint, no 1 GB model, no MLX. The last
line printed is one JSON object; `aggregate_<N>_vs_1` and
`itl_p50_<N>_vs_1` are for the largest count. Design: docs/design/batching.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import aclosing
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import trio

from benchmarks.pipeline import serve_engine, spans
from runtime.inference.chain import ChainHop
from runtime.inference.dispatch import Engine
from runtime.model.backends import load_shard
from runtime.model.backends.base import ShardSpec
from runtime.model.sampling import SamplingParams

MODEL = "concurrency"
PROMPT_TOKENS = 16
"""Every stream's prompt length: one length, so transformers' batch needs
no padding and both sides decode the same positions."""
VOCAB_SIZE = 8192
SEED = 31
ENTRIES = 4
"""Entry nodes the streams are spread over, round robin: a hop gives one
peer at most its share of its sessions (`session_policy.MAX_SESSION_SHARE`,
8 of 16), so 16 streams need two entries, 32 four, as many clients would."""


async def _stream(
    entry: Engine, chain: Sequence[ChainHop], prompt: list[int], tokens: int
) -> list[float]:
    """One greedy generation: when each of its tokens arrived."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    stream = entry.pipeline.generate(MODEL, chain, prompt, params, seed=SEED)
    times: list[float] = []
    async with aclosing(stream) as received:
        async for _token in received:
            times.append(time.perf_counter())
    return times


async def _swarm(
    model_dir: Path, layers: int, hops: int, counts: Sequence[int], tokens: int
) -> list[dict[str, Any]]:
    """Each count of streams through one chain of `hops` in this process."""
    shards = [
        load_shard(ShardSpec(model_dir, a, b, "fp32"), "torch") for a, b in spans(layers, hops)
    ]
    rng = np.random.default_rng(SEED)
    runs = []
    async with trio.open_nursery() as nursery:
        entries: list[Engine] = [
            await nursery.start(serve_engine, None, MODEL) for _ in range(ENTRIES)
        ]
        nodes: list[Engine] = [await nursery.start(serve_engine, s, MODEL) for s in shards]
        chain = [
            ChainHop(n.plane.keys.node_id.hex(), n.plane.address, (s.spec.start, s.spec.end))
            for n, s in zip(nodes, shards, strict=True)
        ]
        for count in counts:
            prompts = [rng.integers(0, VOCAB_SIZE, PROMPT_TOKENS).tolist() for _ in range(count)]
            before = [_batching(node) for node in nodes]
            times: list[list[float]] = []
            began = time.perf_counter()
            async with trio.open_nursery() as streams:
                for index, prompt in enumerate(prompts):
                    entry = entries[index % ENTRIES]
                    streams.start_soon(_collect, times, entry, chain, prompt, tokens)
            wall = time.perf_counter() - began
            after = [_batching(node) for node in nodes]
            runs.append(_figures(count, tokens, wall, times, before, after))
        nursery.cancel_scope.cancel()
    return runs


async def _collect(
    into: list[list[float]], entry: Engine, chain: Sequence[ChainHop], prompt: list[int], n: int
) -> None:
    into.append(await _stream(entry, chain, prompt, n))


def _batching(node: Engine) -> dict[str, Any]:
    stats = node.hop_stats
    assert stats is not None
    return dict(stats["batching"])


def _figures(
    count: int,
    tokens: int,
    wall: float,
    times: list[list[float]],
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
) -> dict[str, Any]:
    gaps = sorted(b - a for stream in times for a, b in pairwise(stream))
    hops = []
    for old, new in zip(before, after, strict=True):
        batches, rows = new["batches"] - old["batches"], new["rows"] - old["rows"]
        hops.append({"batches": batches, "mean_rows": round(rows / max(batches, 1), 2)})
    return {
        "streams": count,
        "aggregate_tok_s": round(count * tokens / wall, 1),
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 2),
        "itl_p99_ms": round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2),
        "hops": hops,
    }


def _ceiling(model_dir: Path, counts: Sequence[int], tokens: int) -> dict[int, float]:
    """transformers' batched greedy `generate` of the whole model: tokens/s per batch size."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    rng = np.random.default_rng(SEED)
    out = {}
    for count in counts:
        ids = torch.tensor(rng.integers(0, VOCAB_SIZE, (count, PROMPT_TOKENS)))
        began = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        out[count] = round(count * tokens / (time.perf_counter() - began), 1)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--streams", default="1,4,16", help="concurrent streams (default 1,4,16)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per stream (default 32)")
    parser.add_argument("--hops", type=int, default=3, help="hops of the chain (default 3)")
    parser.add_argument("--layers", type=int, default=12, help="model layers (default 12)")
    parser.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    args = parser.parse_args(argv)
    counts = sorted({int(n) for n in args.streams.split(",")})
    if counts[0] < 1 or args.tokens < 2 or not 1 <= args.hops <= args.layers:
        parser.error("--streams >= 1, --tokens >= 2 and 1 <= --hops <= --layers")
    from runtime.model.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="shardmesh-concurrency-") as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / MODEL,
            layers=args.layers,
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            vocab_size=VOCAB_SIZE,
            with_manifest=False,
        )
        runs = trio.run(_swarm, model_dir, args.layers, args.hops, counts, args.tokens)
        ceiling = _ceiling(model_dir, counts, args.tokens)
    for run in runs:
        run["transformers_tok_s"] = ceiling[run["streams"]]
    first, last = runs[0], runs[-1]
    n = last["streams"]
    result = {
        "benchmark": "concurrency",
        f"aggregate_{n}_vs_{first['streams']}": round(
            last["aggregate_tok_s"] / first["aggregate_tok_s"], 2
        ),
        f"aggregate_{n}_vs_transformers": round(
            last["aggregate_tok_s"] / last["transformers_tok_s"], 2
        ),
        f"itl_p50_{n}_vs_{first['streams']}": round(last["itl_p50_ms"] / first["itl_p50_ms"], 2),
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": VOCAB_SIZE},
        "hops": args.hops,
        "tokens_per_stream": args.tokens,
        "runs": runs,
    }
    if not args.json:
        for run in runs:
            print(json.dumps(run), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
