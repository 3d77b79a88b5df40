"""Runtime benchmark: shard loading, the doctor, and backend throughput side
by side with transformers' own full model, all measured in one run.

    python -m benchmarks.runtime [--json] [--layers N] [--decode N]

Figures (tiny random models from runtime.model.tiny, built in a temp dir):
- `load_bytes_ratio`: an 8-layer model's shard [2, 4) — a quarter of the
  layers — is loaded by each backend; bytes of tensor data it read (the
  safetensors reader's counter) ÷ bytes of the whole model file on disk.
  A quarter of the layers, and none of the embeddings or LM head, so below
  1/4: the point is that it is not 1.
- `doctor_s`: wall time of one full `run_doctor` (every check, throughput
  included) of the throughput model as one shard, per backend, the first
  in the process (what a starting node pays once its libraries are
  imported); `doctor_warm_s` is a second run. The top level figure is
  torch's. On a shared machine torch's figures can be several times
  slower in one run than the next: its OpenMP threads stall whenever other
  processes hold the cores (mlx's CPU build suffers far less), so compare
  `doctor_s` with `doctor_warm_s` before reading much into either.
- per backend (`torch`, `mlx`): `prefill_tok_s` and `decode_tok_s` of the
  whole throughput model as one shard [0, L), and `chain_*` the same through
  three shards chained in this process (what a 3-hop pipeline costs in
  compute, with no network). Decoding is greedy on the shards' own logits.
- `transformers_decode_tok_s` (and `transformers_prefill_tok_s`): the anchor,
  transformers' `AutoModelForCausalLM` on the torch backend's device, the
  same prompt and greedy decode with its own DynamicCache, called step by
  step like our shards (a manual loop, not `generate`, whose logits
  processors and stopping checks would add overhead our loop does not
  have); `torch_vs_transformers_decode` and `mlx_vs_transformers_decode` are
  our decode rate ÷ that one (1.0 = parity, higher is faster).

Every rate is tokens ÷ seconds from time.perf_counter, the best of
`ROUNDS` runs (a fresh cache each), so one-off warm-up and scheduler noise
do not decide the figure. The throughput model keeps tinymodel's geometry
(hidden 64) with more layers, so per-call overhead, not matmuls, dominates:
these rates compare framework overhead per layer and per step, which is
what a shard adds on top of the same kernels. `greedy_matches_transformers`
says whether each backend's greedy tokens equal transformers' (fp32).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model.backends import BACKENDS, ShardSpec, backend_available, load_shard
from runtime.model.backends.base import ShardBackend
from runtime.model.doctor import run_doctor
from runtime.model.tiny import HIDDEN_SIZE, INTERMEDIATE_SIZE, make_tiny_model
from runtime.model.weights import SINGLE_FILE

LOAD_LAYERS = 8
LOAD_SPAN = (2, 4)
"""A quarter of an 8-layer model, with neither embeddings nor LM head."""

THROUGHPUT_LAYERS = 24
"""Three times the test model: enough layers that per-layer cost, not
per-call setup, decides the rate, while a run stays within seconds on CPU."""

PREFILL_TOKENS = 32
DECODE_STEPS = 32
"""A short chat turn's prompt, and as many greedy tokens after it: enough
single-token steps that the decode rate is a steady mean."""

ROUNDS = 5
"""Runs per figure; the best is kept."""

CHAIN_SHARDS = 3

DOCTOR_RUNS = 2
"""The first doctor run is what a starting node pays (libraries already
imported); the second, warm, shows how much of that was first-use cost."""

RECIPE = "fp32"
"""Throughput in fp32, the recipe transformers' model runs in here, so the
comparison is of frameworks, not of numeric formats."""

_PROMPT_SEED = 0


def load_ratio(model: Path) -> dict[str, Any]:
    """Bytes each backend reads loading LOAD_SPAN, against the file size."""
    file_bytes = (model / SINGLE_FILE).stat().st_size
    result: dict[str, Any] = {"file_bytes": file_bytes}
    for backend in _backends():
        shard = load_shard(ShardSpec(model, *LOAD_SPAN, RECIPE), backend)
        result[backend] = shard.info()["bytes_read"]
    return result


def greedy_chain(
    shards: list[ShardBackend], prompt: np.ndarray, steps: int
) -> tuple[list[int], float, float]:
    """Greedy decode through `shards` (in layer order, one fresh cache
    each): the tokens and the prefill and decode seconds."""
    caches = [shard.new_cache() for shard in shards]

    def step(inputs: np.ndarray, position: int) -> np.ndarray:
        positions = np.arange(position, position + len(inputs), dtype=np.int64)
        for shard, cache in zip(shards, caches, strict=True):
            inputs = shard.forward(inputs, positions, cache)
        return inputs

    began = time.perf_counter()
    logits = step(prompt, 0)
    prefilled = time.perf_counter()
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        logits = step(np.asarray(tokens[-1:], dtype=np.int64), len(prompt) + i)
        tokens.append(int(logits[-1].argmax()))
    return tokens, prefilled - began, time.perf_counter() - prefilled


def transformers_greedy(
    model: Any, prompt: np.ndarray, steps: int
) -> tuple[list[int], float, float]:
    """The same greedy loop on transformers' full model and its own cache."""
    import torch
    from transformers import DynamicCache

    device = model.device
    cache = DynamicCache()
    with torch.inference_mode():
        began = time.perf_counter()
        ids = torch.from_numpy(prompt)[None].to(device)
        logits = model(ids, cache=cache, use_cache=True).logits
        tokens = [int(logits[0, -1].argmax())]
        prefilled = time.perf_counter()
        for _ in range(steps - 1):
            ids = torch.tensor([tokens[-1:]], device=device)
            logits = model(ids, cache=cache, use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
        return tokens, prefilled - began, time.perf_counter() - prefilled


def best_rates(
    run: Callable[[], tuple[list[int], float, float]], prompt_len: int, steps: int
) -> dict[str, Any]:
    """prefill/decode tokens per second, best of ROUNDS, and the tokens.
    Decode counts the steps after the prefill's token (steps - 1 forwards)."""
    tokens: list[int] = []
    prefill_s = decode_s = float("inf")
    for _ in range(ROUNDS):
        tokens, prefill, decode = run()
        prefill_s, decode_s = min(prefill_s, prefill), min(decode_s, decode)
    return {
        "prefill_tok_s": round(prompt_len / prefill_s, 1),
        "decode_tok_s": round((steps - 1) / decode_s, 1),
        "tokens": tokens,
    }


def backend_figures(
    model: Path, backend: str, prompt: np.ndarray, layers: int, steps: int
) -> dict[str, Any]:
    """One backend: doctor wall time, whole-model and 3-shard-chain rates."""
    doctor_s = []
    for _ in range(DOCTOR_RUNS):
        began = time.perf_counter()
        report = run_doctor(model, 0, layers, RECIPE, backend)
        doctor_s.append(time.perf_counter() - began)
        if not report.admitted:
            raise SystemExit(f"doctor refused the benchmark model on {backend}: {report.message}")
    whole = [load_shard(ShardSpec(model, 0, layers, RECIPE), backend)]
    bounds = [round(k * layers / CHAIN_SHARDS) for k in range(CHAIN_SHARDS + 1)]
    spans = list(itertools.pairwise(bounds))
    chain = [load_shard(ShardSpec(model, a, b, RECIPE), backend) for a, b in spans]
    one = best_rates(lambda: greedy_chain(whole, prompt, steps), len(prompt), steps)
    three = best_rates(lambda: greedy_chain(chain, prompt, steps), len(prompt), steps)
    return {
        "device": whole[0].device,
        "doctor_s": round(doctor_s[0], 3),
        "doctor_warm_s": round(doctor_s[-1], 3),
        "doctor_prefill_tok_s": round(report.prefill_tok_s or 0.0, 1),
        "doctor_decode_tok_s": round(report.decode_tok_s or 0.0, 1),
        "prefill_tok_s": one["prefill_tok_s"],
        "decode_tok_s": one["decode_tok_s"],
        "chain_shards": [list(span) for span in spans],
        "chain_prefill_tok_s": three["prefill_tok_s"],
        "chain_decode_tok_s": three["decode_tok_s"],
        "tokens": one["tokens"],
        "chain_tokens_match": three["tokens"] == one["tokens"],
    }


def _backends() -> list[str]:
    return [b for b in BACKENDS if backend_available(b)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument(
        "--layers", type=int, default=THROUGHPUT_LAYERS, help="layers of the throughput model"
    )
    parser.add_argument("--decode", type=int, default=DECODE_STEPS, help="greedy tokens")
    args = parser.parse_args(argv)
    if args.layers < CHAIN_SHARDS or args.decode < 2:
        parser.error(f"need --layers >= {CHAIN_SHARDS} and --decode >= 2")
    if not backend_available("torch"):
        parser.error("the benchmark needs the torch backend (transformers is its anchor)")

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardmesh-bench-") as tmp:
        say(f"building tiny models ({LOAD_LAYERS} and {args.layers} layers) ...")
        load_model = make_tiny_model(Path(tmp) / "load", layers=LOAD_LAYERS, with_manifest=False)
        model = make_tiny_model(Path(tmp) / "throughput", layers=args.layers)
        loads = load_ratio(load_model)
        say(f"  load: {json.dumps(loads)}")

        rng = np.random.default_rng(_PROMPT_SEED)
        config = json.loads((model / "config.json").read_text())
        prompt = rng.integers(0, config["vocab_size"], size=PREFILL_TOKENS, dtype=np.int64)
        backends: dict[str, Any] = {}
        for backend in _backends():
            say(f"{backend}: doctor, whole model, {CHAIN_SHARDS}-shard chain ...")
            backends[backend] = backend_figures(model, backend, prompt, args.layers, args.decode)
            say(f"  {json.dumps({k: v for k, v in backends[backend].items() if k != 'tokens'})}")

        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

        say("transformers: full model ...")
        device = backends["torch"]["device"]
        full = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa")
        full = full.to(device).eval()
        anchor = best_rates(
            lambda: transformers_greedy(full, prompt, args.decode), len(prompt), args.decode
        )
        say(f"  {json.dumps({k: v for k, v in anchor.items() if k != 'tokens'})}")

    result: dict[str, Any] = {
        "benchmark": "runtime",
        "load_model": {
            "layers": LOAD_LAYERS,
            "span": list(LOAD_SPAN),
            "file_bytes": loads["file_bytes"],
        },
        "load_bytes_ratio": round(loads["torch"] / loads["file_bytes"], 4),
        "load_bytes_ratio_by_backend": {
            b: round(loads[b] / loads["file_bytes"], 4) for b in backends
        },
        "throughput_model": {
            "layers": args.layers,
            "hidden_size": HIDDEN_SIZE,
            "intermediate_size": INTERMEDIATE_SIZE,
            "vocab_size": config["vocab_size"],
            "recipe": RECIPE,
            "prefill_tokens": PREFILL_TOKENS,
            "decode_tokens": args.decode,
            "rounds": ROUNDS,
        },
        "doctor_s": backends["torch"]["doctor_s"],
        "transformers_decode_tok_s": anchor["decode_tok_s"],
        "transformers_prefill_tok_s": anchor["prefill_tok_s"],
        "transformers_device": device,
    }
    for backend, figures in backends.items():
        tokens = figures.pop("tokens")
        figures["greedy_matches_transformers"] = tokens == anchor["tokens"]
        result[backend] = figures
        result[f"{backend}_vs_transformers_decode"] = round(
            figures["decode_tok_s"] / anchor["decode_tok_s"], 3
        )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
