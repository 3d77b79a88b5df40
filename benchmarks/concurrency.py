"""Concurrency benchmark (issue 31): many streams at once through a swarm, beside the ceiling.

    python -m benchmarks.concurrency [--json] [--quick] [--streams 1,4,16,32]
                                     [--tokens N] [--models real,synthetic]
                                     [--backends torch[,mlx]]

A three-hop local swarm of real `shardmesh node` processes on loopback (the
model split in three spans; the first node is also the entry) serves 1, 4,
16 and 32 concurrent greedy streaming chats, each from its own client
address (127.0.0.x: the per-client chat quota is 4). Per count: aggregate
decode tok/s, p50/p99 inter-token time (SSE chunk arrivals) and each hop's
batching counters (`hop.batching` of `/v1/network/status`, the run's delta).
Beside them, in this process, transformers' batched greedy `generate` of the
whole model at the same batch sizes (left-padded, fp32): the ceiling.
Models: the real pretrained checkpoint the tests use (SmolLM2-135M, fp32)
and a random model of >= 1 GB of fp32 weights; `--quick` runs the tiny
model at 1 and 4 streams (the test). The last line printed is one JSON
object; what each key means: docs/benchmarks.md#concurrency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.pipeline import spans
from runtime.cli.chat_client import sse_chunks
from runtime.cli.localswarm import LocalNode, LocalSwarm
from runtime.model.manifest import load_manifest
from runtime.model.tiny import LARGE_HEAD_DIM, make_tiny_model

HOPS = 3
STREAM_COUNTS = (1, 4, 16, 32)
QUICK_COUNTS = (1, 4)
TOKENS = 64
"""Per stream, as the issue measured: long enough that the streams' staggered
prefills (the first tokens come over several hundred milliseconds at 16
streams) do not decide the aggregate; at 16 tokens they did (1.6x one
stream's rate, against 2.6-3.2x at 48-96 tokens, same machine)."""
QUICK_TOKENS = 8
HEADLINE_STREAMS = 16
"""The count the top-level keys compare with one stream (the issue's)."""
TARGETS = {"aggregate_vs_1": 5.0, "aggregate_vs_transformers": 0.6, "itl_p50_vs_1": 3.0}
MAX_SESSIONS = 64
"""Every hop's `--max-sessions`. One entry takes all streams, as one API
front door does for many users; a hop gives one peer at most half its
sessions (`session_policy.MAX_SESSION_SHARE`: 8 of the default 16), so 32
streams through one entry need 64. Raising it, rather than adding entry
processes, keeps three processes on the machine's cores, not five."""
CLIENT_HOST = "127.0.0.{}"
FIRST_CLIENT = 10
"""Stream i comes from 127.0.0.(10 + i): its own client under the per-client
chat quota (4), as many users would be; 127.0.0.1 is the nodes' own."""
SYNTHETIC = {"layers": 8, "hidden_size": 1536, "intermediate_size": 6144}
"""The random model: 8 layers of width 1536 (head size 64, as real models),
~1.1 GB of fp32 weights. The tokenizer's own vocabulary (512): ids past it
(a padded vocabulary) decode to no text, so a stream would show no tokens."""
TOPICS = ("the sea", "a city", "the stars", "a forest", "winter", "a library", "trains", "bees")
READY_TIMEOUT_S = 300.0
"""Three processes load a 1 GB model on a loaded 2-core machine: minutes."""
HTTP_TIMEOUT_S = 600.0
CEILING_THREADS = 1
"""transformers' compute threads, one as each node has (localswarm's
SHARED_MACHINE_ENV): on a shared machine torch's OpenMP threads wait on
each other at every op (benchmarks/pipeline.py measured 60x slower decode
with 2 threads beside a busy process). `--ceiling-threads` changes it."""


def body(index: int, model: str, tokens: int) -> dict[str, Any]:
    """Stream `index`'s request: greedy, streamed, its own prompt."""
    topic = TOPICS[index % len(TOPICS)]
    text = f"Write a long story about {topic}, part {index + 1}."
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream(index: int, api: str, request: dict[str, Any]) -> dict[str, Any]:
    """One chat from its own address: its content chunks' arrival times and tokens."""
    address = CLIENT_HOST.format(FIRST_CLIENT + index)
    transport = httpx.AsyncHTTPTransport(local_address=address)
    arrivals: list[float] = []
    usage = None
    url = f"{api}/v1/chat/completions"
    async with (
        httpx.AsyncClient(transport=transport, timeout=HTTP_TIMEOUT_S) as client,
        client.stream("POST", url, json=request) as answer,
    ):
        if answer.status_code != 200:
            await answer.aread()
            raise RuntimeError(f"stream {index}: {answer.status_code} {answer.text}")
        async for chunk in sse_chunks(answer):
            usage = chunk.get("usage") or usage
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    assert usage is not None and arrivals, f"stream {index} got no tokens"
    return {"arrivals": arrivals, "tokens": usage["completion_tokens"]}


@asynccontextmanager
async def serve(
    root: Path, model_dir: Path, backend: str, threads: int
) -> AsyncIterator[tuple[LocalSwarm, list[LocalNode]]]:
    """A three-hop swarm of `model_dir` on loopback, every layer covered."""
    manifest = load_manifest(model_dir)
    name, layers = manifest["name"], manifest["num_layers"]
    node_args = ["--max-sessions", str(MAX_SESSIONS), "--backend", backend]
    env = {"OMP_NUM_THREADS": str(threads)}
    async with LocalSwarm(root, profile="local", node_args=node_args, extra_env=env) as swarm:
        nodes = [
            swarm.new_node(args=["--model", str(model_dir), "--layers", f"{a}:{b}"])
            for a, b in spans(layers, HOPS)
        ]
        await swarm.start_ready(nodes[0], timeout=READY_TIMEOUT_S)
        await swarm.start_many(nodes[1:], [nodes[0].seed], timeout=READY_TIMEOUT_S)

        def ready(views: dict[str, Any]) -> bool:
            coverage = (views[nodes[0].name] or {}).get("coverage", {}).get(name)
            return bool(coverage) and not coverage["gaps"] and coverage["layers"] == layers

        await swarm.wait_for(nodes[:1], ready, READY_TIMEOUT_S, f"{name} served")
        yield swarm, nodes


async def _batching(swarm: LocalSwarm, nodes: Sequence[LocalNode]) -> list[dict[str, Any]]:
    views = await swarm.views(nodes)
    return [dict(((views[n.name] or {}).get("hop") or {}).get("batching") or {}) for n in nodes]


async def _measure_count(
    swarm: LocalSwarm, nodes: Sequence[LocalNode], name: str, count: int, tokens: int
) -> dict[str, Any]:
    """`count` streams at once through the entry; the count's figures."""
    before = await _batching(swarm, nodes)
    streams: list[dict[str, Any]] = []

    async def one(index: int) -> None:
        streams.append(await _stream(index, nodes[0].api, body(index, name, tokens)))

    async with trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(one, index)
    after = await _batching(swarm, nodes)
    return {"streams": count, **stream_figures(streams), "hops": hop_figures(before, after)}


def stream_figures(streams: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate decode tok/s (every stream's tokens after its first, over the
    time from the earliest first token to the latest last one) and the
    inter-token gaps' p50/p99 over all streams."""
    first = min(s["arrivals"][0] for s in streams)
    last = max(s["arrivals"][-1] for s in streams)
    decoded = sum(s["tokens"] - 1 for s in streams)
    gaps = sorted(b - a for s in streams for a, b in pairwise(s["arrivals"]))
    return {
        "aggregate_tok_s": round(decoded / (last - first), 2) if last > first else None,
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 2) if gaps else None,
        "itl_p99_ms": round(1e3 * _quantile(gaps, 0.99), 2) if gaps else None,
        "tokens": [s["tokens"] for s in streams],
    }


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hop_figures(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> list[dict]:
    """Each hop's batches over the run: how many, rows, mean and largest batch, sizes."""
    hops = []
    for old, new in zip(before, after, strict=True):
        batches = new.get("batches", 0) - old.get("batches", 0)
        rows = new.get("rows", 0) - old.get("rows", 0)
        sizes = {
            size: n - old.get("sizes", {}).get(size, 0)
            for size, n in new.get("sizes", {}).items()
            if n - old.get("sizes", {}).get(size, 0)
        }
        hops.append(
            {
                "batches": batches,
                "rows": rows,
                "mean_rows": round(rows / batches, 2) if batches else 0.0,
                "largest": max((int(s) for s in sizes), default=0),
                "sizes": sizes,
            }
        )
    return hops


async def swarm_runs(
    root: Path, model_dir: Path, counts: Sequence[int], tokens: int, backend: str, threads: int
) -> list[dict[str, Any]]:
    """Every count through one swarm, after a one-stream warm-up."""
    name = load_manifest(model_dir)["name"]
    async with serve(root, model_dir, backend, threads) as (swarm, nodes):
        await _measure_count(swarm, nodes, name, 1, min(tokens, QUICK_TOKENS))  # warm-up
        return [await _measure_count(swarm, nodes, name, n, tokens) for n in counts]


def ceiling(model_dir: Path, counts: Sequence[int], tokens: int, threads: int) -> dict[int, float]:
    """transformers' batched greedy `generate` of the whole model, the same
    prompts left-padded: decode tok/s per batch size, (tokens - 1) per row
    over the time `tokens` new tokens take beyond one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    name = load_manifest(model_dir)["name"]

    def timed(batch: dict[str, Any], new: int) -> float:
        began = time.perf_counter()
        with torch.no_grad():
            model.generate(
                **batch, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        return time.perf_counter() - began

    rates = {}
    for count in counts:
        texts = [
            tokenizer.apply_chat_template(
                body(i, name, tokens)["messages"], add_generation_prompt=True, tokenize=False
            )
            for i in range(count)
        ]
        batch = dict(tokenizer(texts, return_tensors="pt", padding=True))
        timed(batch, 2)  # warm-up
        decode_s = timed(batch, tokens) - timed(batch, 1)
        rates[count] = round(count * (tokens - 1) / decode_s, 2)
    return rates


def model_figures(
    root: Path, model_dir: Path, counts: Sequence[int], tokens: int, backends: Sequence[str],
    threads: int, ceiling_threads: int,
) -> dict[str, Any]:  # fmt: skip
    """One model's runs on each backend, each count beside the ceiling."""
    manifest = load_manifest(model_dir)
    weights = model_dir.glob("*.safetensors")
    out: dict[str, Any] = {
        "name": manifest["name"],
        "layers": manifest["num_layers"],
        "weights_gb": round(sum(f.stat().st_size for f in weights) / 1e9, 3),
        "spans": spans(manifest["num_layers"], HOPS),
    }
    for backend in backends:
        runs = trio.run(swarm_runs, root / backend, model_dir, counts, tokens, backend, threads)
        out[backend] = runs
    rates = ceiling(model_dir, counts, tokens, ceiling_threads)
    out["transformers_tok_s"] = {str(n): rate for n, rate in rates.items()}
    for backend in backends:
        for run in out[backend]:
            run["transformers_tok_s"] = rates[run["streams"]]
            if run["aggregate_tok_s"] is not None:
                run["vs_transformers"] = round(run["aggregate_tok_s"] / rates[run["streams"]], 3)
    return out


def headline(runs: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """The top-level keys: the run at `n` streams against the one stream and the ceiling."""
    by_count = {run["streams"]: run for run in runs}
    one, many = by_count[1], by_count[n]
    return {
        f"aggregate_{n}_vs_1": round(many["aggregate_tok_s"] / one["aggregate_tok_s"], 3),
        f"aggregate_{n}_vs_transformers": many["vs_transformers"],
        f"itl_p50_{n}_vs_1": round(many["itl_p50_ms"] / one["itl_p50_ms"], 3),
    }


def _real_model() -> Path:
    from runtime.model.pretrained import smollm2_135m
    from runtime.model.progress import Progress

    with Progress("smollm2-135m") as progress:
        return smollm2_135m(progress=progress).folder


def _make_model(root: Path, kind: str) -> Path:
    """The model folder of `kind`: real (the pretrained checkpoint), synthetic
    (random, >= 1 GB of fp32 weights) or tiny (the test model, for --quick)."""
    if kind == "real":
        return _real_model()
    if kind == "synthetic":
        assert SYNTHETIC["hidden_size"] % LARGE_HEAD_DIM == 0
        return make_tiny_model(
            root / "synthetic", layers=SYNTHETIC["layers"], name="synthetic",
            hidden_size=SYNTHETIC["hidden_size"],
            intermediate_size=SYNTHETIC["intermediate_size"],
        )  # fmt: skip
    return make_tiny_model(root / "tiny", layers=8, name="tiny")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 and 4 streams")
    parser.add_argument("--streams", default=None, help="stream counts (default 1,4,16,32)")
    parser.add_argument("--tokens", type=int, default=None, help=f"per stream (default {TOKENS})")
    parser.add_argument("--models", default="real,synthetic", help="real, synthetic, tiny")
    parser.add_argument("--backends", default="torch", help="node backends: torch, mlx")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per node")
    parser.add_argument("--ceiling-threads", type=int, default=CEILING_THREADS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    quick_counts = ",".join(map(str, QUICK_COUNTS if args.quick else STREAM_COUNTS))
    counts = sorted({int(n) for n in (args.streams or quick_counts).split(",")} | {1})
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    kinds = ["tiny"] if args.quick else args.models.split(",")
    backends = args.backends.split(",")
    if tokens < 3 or not set(kinds) <= {"real", "synthetic", "tiny"}:
        parser.error("--tokens >= 3; --models from real, synthetic, tiny")
    n = HEADLINE_STREAMS if HEADLINE_STREAMS in counts else counts[-1]
    began = time.perf_counter()
    models = {}
    with tempfile.TemporaryDirectory(prefix="shardmesh-concurrency-") as tmp:
        for kind in kinds:
            model_dir = _make_model(Path(tmp), kind)
            models[kind] = model_figures(
                Path(tmp) / f"{kind}-swarm", model_dir, counts, tokens, backends,
                args.threads, args.ceiling_threads,
            )  # fmt: skip
            print(json.dumps({kind: models[kind]}), file=sys.stderr)  # kept if a later one fails
    result = {
        "benchmark": "concurrency",
        **headline(models[kinds[0]][backends[0]], n),
        "headline": {"model": kinds[0], "backend": backends[0], "streams": n},
        "targets": {
            f"aggregate_{n}_vs_1": f">= {TARGETS['aggregate_vs_1']}",
            f"aggregate_{n}_vs_transformers": f">= {TARGETS['aggregate_vs_transformers']}",
            f"itl_p50_{n}_vs_1": f"<= {TARGETS['itl_p50_vs_1']}",
        },
        "hops": HOPS,
        "max_sessions": MAX_SESSIONS,
        "tokens_per_stream": tokens,
        "threads_per_node": args.threads,
        "ceiling_threads": args.ceiling_threads,
        "models": models,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
