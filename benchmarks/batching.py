"""Batching benchmark: one batched decode step of 16 sessions against the
same 16 sessions stepping alone, on each installed backend.

    python -m benchmarks.batching [--json] [--sessions N] [--context N]
                                  [--device DEV] [--backends torch,mlx]

A random model of real proportions (heads of 64, `HIDDEN_SIZE` wide, a
`VOCAB_SIZE` LM head) is built in a temporary folder and loaded whole as one
shard. Each session is prefilled alone with a prompt of its own length
(spread around `--context`), then decode steps alternate between the two
ways on the very same caches: every session's `forward` in turn, and one
`forward_batch` of them all. Rates are the median of `ROUNDS` steps of each.
`gather_ms` times the batched step's extra work alone: every layer's copy
of the sessions' keys and values into one padded batch. The last line
printed is one JSON object; `batched_16_vs_solo` is the first backend's
throughput ratio (tokens per second batched / alone) for 16 sessions.
Design: docs/design/batching.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model.backends import BACKENDS, ShardSpec, backend_available, load_shard
from runtime.model.backends.base import KVCache, ShardBackend

SESSIONS = 16
"""Sessions decoding at once: a busy hop's batch."""

CONTEXT = 128
"""Mean cached tokens per session: a chat turn into its answer (more
makes MLX's CPU build prefill for minutes: its matmuls run at a tenth of
torch's speed there)."""

CONTEXT_SPREAD = 0.5
"""Prompts range over (1 +- this) * context, so rows differ in length and
the padded batch holds padding, as a real one does."""

LAYERS = 8
HIDDEN_SIZE = 512
INTERMEDIATE_SIZE = 1536
VOCAB_SIZE = 8192
"""A small model's proportions (8 heads of 64, 4 KV heads, a 3x MLP and a
head 16x the width): every matmul is a real one, yet a run takes about a
minute of a laptop's CPU."""

ROUNDS = 8
"""Decode steps timed each way; the median is kept (a step or two of a
shared CPU's noise should not decide a figure)."""

SEED = 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--sessions", type=int, default=SESSIONS)
    parser.add_argument("--context", type=int, default=CONTEXT, help="mean cached tokens")
    parser.add_argument("--device", default=None, help="torch device (default: the best here)")
    parser.add_argument(
        "--backends",
        default=",".join(b for b in BACKENDS if backend_available(b)),
        help="comma-separated backends to measure",
    )
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if args.sessions < 1 or args.context < 2 or not args.backends:
        parser.error("need --sessions >= 1, --context >= 2 and a backend")
    return args


def prompt_lengths(sessions: int, context: int) -> list[int]:
    """Each session's prompt length, spread evenly over (1 +- CONTEXT_SPREAD)
    * context, shortest first."""
    low = max(1, round(context * (1 - CONTEXT_SPREAD)))
    high = max(low, round(context * (1 + CONTEXT_SPREAD)))
    return [int(n) for n in np.linspace(low, high, sessions).round()]


class Sessions:
    """Sessions on one shard: caches, last tokens and positions."""

    def __init__(self, shard: ShardBackend, lengths: Sequence[int]) -> None:
        rng = np.random.default_rng(SEED)
        self.shard = shard
        self.caches: list[KVCache] = [shard.new_cache() for _ in lengths]
        self.last: list[int] = []
        self.positions = list(lengths)
        for cache, length in zip(self.caches, lengths, strict=True):
            prompt = rng.integers(0, shard.vocab_size, length)
            logits = shard.forward(prompt, np.arange(length), cache)
            self.last.append(int(logits[-1].argmax()))

    def steps(self) -> list[tuple[np.ndarray, np.ndarray, KVCache]]:
        return [
            (np.asarray([token]), np.asarray([position]), cache)
            for token, position, cache in zip(self.last, self.positions, self.caches, strict=True)
        ]

    def advance(self, logits: Sequence[np.ndarray]) -> None:
        self.last = [int(row[-1].argmax()) for row in logits]
        self.positions = [p + 1 for p in self.positions]

    def alone(self) -> None:
        self.advance([self.shard.forward(*step) for step in self.steps()])

    def batched(self) -> None:
        self.advance(self.shard.forward_batch(self.steps()))


def _timed(action: Callable[[], None]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def gather_ms(sessions: Sessions) -> float:
    """Milliseconds of the padded key and value copies of one batched step
    of these sessions (every layer): the price of keeping every session's
    cache its own (torch also appends to each session's cache by copying
    it, alone or batched)."""
    if sessions.shard.name == "torch":
        return _torch_gather_ms(sessions)
    return _mlx_gather_ms(sessions)


def _torch_gather_ms(sessions: Sessions) -> float:
    from runtime.model.backends import torch_adapter

    inners = [cache.inner for cache in sessions.caches]  # type: ignore[attr-defined]
    per_session = [torch_adapter.cached_keys(inner) for inner in inners]
    slots = max(sessions.positions)

    def copy() -> None:
        for layer in range(len(per_session[0])):
            for part in (0, 1):  # keys, values
                torch_adapter.right_padded([kv[layer][part] for kv in per_session], slots)

    return _median_ms(copy)


def _mlx_gather_ms(sessions: Sessions) -> float:
    import mlx.core as mx

    from runtime.model.backends import mlx_adapter

    layers = [cache.layers for cache in sessions.caches]  # type: ignore[attr-defined]
    per_session = [mlx_adapter.cached_keys(caches) for caches in layers]
    slots = max(sessions.positions)

    def copy() -> None:
        padded = [
            mlx_adapter.right_padded([kv[layer][part] for kv in per_session], slots)
            for layer in range(len(per_session[0]))
            for part in (0, 1)  # keys, values
        ]
        mx.eval(padded)

    return _median_ms(copy)


def _median_ms(action: Callable[[], None]) -> float:
    action()  # warm the allocator
    return 1000 * statistics.median(_timed(action) for _ in range(ROUNDS))


def measure(shard: ShardBackend, lengths: Sequence[int]) -> dict[str, Any]:
    """Median step times alone and batched, alternating on the same caches."""
    sessions = Sessions(shard, lengths)
    sessions.alone()  # warm-up, each way
    sessions.batched()
    alone, batched = [], []
    for _ in range(ROUNDS):
        alone.append(_timed(sessions.alone))
        batched.append(_timed(sessions.batched))
    alone_s, batched_s = statistics.median(alone), statistics.median(batched)
    count = len(lengths)
    return {
        "device": shard.device,
        "alone_step_ms": round(1000 * alone_s, 2),
        "batched_step_ms": round(1000 * batched_s, 2),
        "alone_tok_s": round(count / alone_s, 1),
        "batched_tok_s": round(count / batched_s, 1),
        "batched_vs_alone": round(alone_s / batched_s, 2),
        "gather_ms": round(gather_ms(sessions), 2),
    }


def _load(model_dir: Path, backend: str, device: str | None) -> ShardBackend:
    spec = ShardSpec(model_dir, 0, LAYERS, "fp32")
    if backend == "torch" and device is not None:
        from runtime.model.backends.torch_backend import load_torch_shard

        return load_torch_shard(spec, device)
    return load_shard(spec, backend)


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    from runtime.model.tiny import make_tiny_model

    lengths = prompt_lengths(args.sessions, args.context)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shardmesh-batching-") as tmp:
        say(f"building a {LAYERS}-layer model {HIDDEN_SIZE} wide ...")
        model_dir = make_tiny_model(
            Path(tmp) / "model",
            layers=LAYERS,
            hidden_size=HIDDEN_SIZE,
            intermediate_size=INTERMEDIATE_SIZE,
            vocab_size=VOCAB_SIZE,
            with_manifest=False,
        )
        for backend in args.backends:
            say(f"{backend}: {args.sessions} sessions, prompts {lengths[0]}..{lengths[-1]} ...")
            results[backend] = measure(_load(model_dir, backend, args.device), lengths)
            say(f"  {json.dumps(results[backend])}")
    first = results[args.backends[0]]
    return {
        "sessions": args.sessions,
        "prompt_lengths": [lengths[0], lengths[-1]],
        "model": {"layers": LAYERS, "hidden_size": HIDDEN_SIZE, "vocab_size": VOCAB_SIZE},
        "backends": results,
        f"batched_{args.sessions}_vs_solo": first["batched_vs_alone"],
    }


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    result = run(args, say)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
