"""The doctor: node capability admission (`shardmesh doctor`).

No tier skips it: before a node advertises a shard it proves, on its own
hardware and libraries, that it computes that shard correctly, because a
corrupted download, a buggy driver or a doctored checkpoint answers fast and
wrong. `run_doctor` runs its checks in order and stops at the first failure:
backend, manifest, span, recipe, memory, tensors (digests), load, probe (the
manifest's golden input through the shard, compared with its golden output)
and throughput. A refusal is a `DoctorReport` with `admitted=False`, the
failed check and a reason code; nothing an operator can cause raises.
`recheck` is a serving node's cheap refresh, `preflight` what `shardmesh
node` checks before joining without loading a backend.

Each check, the reason codes, and why digests and the probe both:
docs/design/doctor.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model.architectures import recipe_refusal
from runtime.model.backends import (
    BACKENDS,
    REQUIRED_MODULES,
    backend_available,
    default_backend,
    import_libraries,
    load_shard,
)
from runtime.model.backends.base import BackendError, ShardBackend, ShardSpec
from runtime.model.manifest import (
    MANIFEST_FILE,
    Golden,
    ManifestError,
    file_sha256,
    load_golden,
    load_manifest,
    manifest_digest,
)
from runtime.model.progress import Progress
from runtime.model.recipes import (
    CALIBRATION_MARGIN,
    RECIPES,
    Recipe,
    calibrated_tolerance,
    check_recipe,
    relative_error,
    row_errors,
)
from runtime.model.weights import (
    SafetensorsReader,
    ShardLoadError,
    read_config,
    tensor_names_for_shard,
)

# Modules each backend imports when it loads a shard (and the distributions
# whose versions the report records). Importing them, not just finding
# them, is the check: a half-installed wheel is found but fails to import.
_BACKEND_DISTRIBUTIONS = {"torch": ("torch", "transformers"), "mlx": ("mlx", "mlx-lm")}

# Loading holds the raw bytes read from disk and the backend's converted
# tensors at the same time, so the peak is about twice the stored shard; on
# a GPU the same margin leaves room for activations and KV caches. A node
# below it would load and then die mid-session, which is worse than a
# refusal now.
LOAD_PEAK_FACTOR = 2.0

# Throughput: a 32-token prompt is a short chat turn, run as one batched
# forward as real prompts are, and 16 single-token steps through the cache
# show the steady decode rate. The best of 3 rounds is
# kept, so a first-call warm-up or a scheduler hiccup does not understate a
# node's speed; on an 80-layer shard this still takes seconds, not minutes.
PREFILL_TOKENS = 32
DECODE_STEPS = 16
MEASURE_ROUNDS = 3

# What a backend may raise at load or forward time because of the machine,
# not our code: its own refusals, running out of (GPU) memory — torch's
# OutOfMemoryError is a RuntimeError — and a device lacking a kernel
# (NotImplementedError, also a RuntimeError). They refuse the shard; a
# crashed doctor would take the node down instead of reporting why.
_ENVIRONMENT_ERRORS = (BackendError, MemoryError, RuntimeError)

# Fixed seed for the synthetic throughput inputs, so two runs time the same
# work (the values do not matter to the speed, only the shapes do).
_MEASURE_SEED = 0


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome. `details` holds its numbers (JSON-ready);
    `reason` and `message` are set when it failed."""

    name: str
    ok: bool
    details: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    message: str | None = None


@dataclass(slots=True)
class DoctorReport:
    """What the doctor found; the node signs and gossips it when admitted."""

    admitted: bool
    failed_check: str | None
    reason: str | None
    message: str | None
    checks: list[Check]
    manifest_digest: str | None
    model: str | None
    num_layers: int | None  # of the whole model, from its manifest
    layers: list[int]
    recipe: str
    backend: str | None
    device: str | None
    prefill_tok_s: float | None
    decode_tok_s: float | None
    duration_s: float
    checked_at: float  # UNIX time the run ended
    mode: str  # "full" (run_doctor), "recheck" or "preflight"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON types."""
        return asdict(self)

    def to_json(self) -> str:
        """The report as one JSON object (strict JSON: no NaN or Infinity)."""
        return json.dumps(self.to_dict(), allow_nan=False)


@dataclass(frozen=True, slots=True)
class Throughput:
    """Measured speed of one shard: tokens per second, best of `rounds`."""

    prefill_tok_s: float
    decode_tok_s: float
    prefill_tokens: int
    decode_steps: int
    rounds: int


class _Refused(Exception):
    """Raised inside a check to fail it with a reason code and numbers."""

    def __init__(self, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.details = details


@dataclass
class _Run:
    """State shared by the checks of one doctor run."""

    model_dir: Path
    start: int
    end: int
    recipe_name: str
    backend: str | None
    device: str | None = None
    manifest: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    golden: Golden | None = None
    recipe: Recipe | None = None
    shard: ShardBackend | None = None
    throughput: Throughput | None = None
    progress: Progress | None = None
    """Hears of each check as it starts (and of each tensor hashed)."""


def run_doctor(
    model_dir: Path,
    start: int,
    end: int,
    recipe: str,
    backend: str | None = None,
    *,
    measure: bool = True,
    progress: Progress | None = None,
) -> DoctorReport:
    """Check that this machine computes layers [start, end) of the model in
    `model_dir` correctly in `recipe` on `backend` (default: the platform's
    default backend). Never raises for a refusal (the checks and reason
    codes: docs/design/doctor.md).
    `progress` hears of each check as it starts."""
    run = _Run(Path(model_dir), start, end, recipe, backend or default_backend())
    run.progress = progress
    return _execute(run, _full_steps(measure), mode="full")


def preflight(
    model_dir: Path, start: int, end: int, recipe: str, backend: str | None = None
) -> DoctorReport:
    """The doctor's checks that import no backend and read no weights: a
    node runs them before joining, so an operator's mistake stops it at
    once with one line, instead of a failed admission after it joined (the
    recipe's support on the device needs the backend: the doctor checks it)."""
    run = _Run(Path(model_dir), start, end, recipe, backend or default_backend())
    steps = [("backend", _check_backend_installed), ("manifest", _check_manifest)]
    steps += [("span", _check_span), ("recipe", _check_recipe_for_model)]
    return _execute(run, steps, mode="preflight")


def backend_refusal(backend: str | None = None) -> str | None:
    """Why `backend` (default: the platform's) cannot run here, or None:
    the doctor's first check alone, importing nothing. `shardmesh serve`
    runs it before it joins, when there is no manifest or span to check."""
    try:  # the check reads only the backend's name: no model, span or recipe
        _check_backend_installed(_Run(Path(), 0, 0, "", backend or default_backend()))
    except _Refused as refusal:
        return refusal.message
    return None


def _full_steps(measure: bool) -> list[tuple[str, Any]]:
    steps = [
        ("backend", _check_backend),
        ("manifest", _check_manifest),
        ("span", _check_span),
        ("recipe", _check_recipe),
        ("memory", _check_memory),
        ("tensors", _check_tensors),
        ("load", _check_load),
        ("probe", _check_probe),
    ]
    if measure:
        steps.append(("throughput", _check_throughput))
    return steps


def admit(
    model_dir: Path,
    start: int,
    end: int,
    recipe: str,
    backend: str | None = None,
    progress: Progress | None = None,
) -> tuple[DoctorReport, ShardBackend | None]:
    """The full doctor, and the shard it checked when it admits it: a node
    serves the very object that passed the probe, not a second load that
    could differ (and would cost a second read of the weights)."""
    run = _Run(Path(model_dir), start, end, recipe, backend or default_backend())
    run.progress = progress
    report = _execute(run, _full_steps(measure=True), mode="full")
    return report, run.shard if report.admitted else None


def recheck(
    model_dir: Path,
    start: int,
    end: int,
    recipe: str,
    backend: str | None = None,
    *,
    shard: ShardBackend | None = None,
    digests: bool = False,
) -> DoctorReport:
    """The cheap refresh: the probe forward only (no memory check, no
    throughput), on `shard` when the node already holds it (its spec must be
    this one; a fresh KV cache is used, so serving sessions are untouched),
    else on a freshly loaded shard. `digests=True` also re-hashes the
    shard's tensors, which reads its whole weights from disk. The probe
    runs on the caller's thread: call it where the node runs its other
    forwards of `shard`, as backends are not promised to be thread-safe."""
    held_backend = shard.name if shard is not None else None
    run = _Run(Path(model_dir), start, end, recipe, backend or held_backend or default_backend())
    if shard is not None:
        wanted = ShardSpec(run.model_dir.resolve(), start, end, recipe)
        spec = shard.spec
        held = ShardSpec(Path(spec.model_dir).resolve(), spec.start, spec.end, spec.recipe)
        if held != wanted or shard.name != run.backend:
            raise ValueError(
                f"recheck of {wanted} on {run.backend} given a {shard.name} shard of {shard.spec}"
            )
        run.shard = shard
        run.device = shard.device
    steps = [("manifest", _check_manifest), ("span", _check_span)]
    if shard is None:
        steps.insert(0, ("backend", _check_backend))
        steps.append(("recipe", _check_recipe))
    if digests:
        steps.append(("tensors", _check_tensors))
    if shard is None:
        steps.append(("load", _check_load))
    steps.append(("probe", _check_probe))
    return _execute(run, steps, mode="recheck")


def measure_throughput(
    shard: ShardBackend,
    prefill_tokens: int = PREFILL_TOKENS,
    decode_steps: int = DECODE_STEPS,
    rounds: int = MEASURE_ROUNDS,
) -> Throughput:
    """Prefill and decode speed of `shard`, timed with perf_counter: a
    `prefill_tokens` prompt into a fresh cache, then `decode_steps`
    single-token steps continuing it; best of `rounds`. A shard holding the
    whole model decodes greedily (its own argmax); other shards get fixed
    synthetic token ids or hidden states of the right shape."""
    rng = np.random.default_rng(_MEASURE_SEED)
    total = prefill_tokens + decode_steps
    if shard.is_first:
        inputs: np.ndarray = rng.integers(0, shard.vocab_size, size=total, dtype=np.int64)
    else:
        inputs = rng.standard_normal((total, shard.hidden_size)).astype(np.float32)
    greedy = shard.is_first and shard.is_last
    best_prefill = best_decode = math.inf
    for _ in range(rounds):
        cache = shard.new_cache()
        began = time.perf_counter()
        out = shard.forward(inputs[:prefill_tokens], np.arange(prefill_tokens), cache)
        prefilled = time.perf_counter()
        for step in range(prefill_tokens, total):
            token = (
                np.asarray([out[-1].argmax()], dtype=np.int64)
                if greedy
                else inputs[step : step + 1]
            )
            out = shard.forward(token, np.asarray([step], dtype=np.int64), cache)
        decoded = time.perf_counter()
        best_prefill = min(best_prefill, prefilled - began)
        best_decode = min(best_decode, decoded - prefilled)
    return Throughput(
        prefill_tok_s=prefill_tokens / best_prefill,
        decode_tok_s=decode_steps / best_decode,
        prefill_tokens=prefill_tokens,
        decode_steps=decode_steps,
        rounds=rounds,
    )


def free_memory_bytes(device: str) -> tuple[int | None, str]:
    """Bytes free for a shard on `device` and where the figure came from.

    CUDA reports its own free memory; everything else (CPU, and Apple's
    unified memory behind MPS and Metal) draws on system RAM: Linux's
    MemAvailable (free plus reclaimable cache), else sysconf's available
    pages, else — on macOS, which lacks that — physical memory, the best
    bound there is without extra packages. None when nothing answers."""
    if device.startswith("cuda"):
        import torch

        try:
            free, _total = torch.cuda.mem_get_info(torch.device(device))
        except RuntimeError as exc:  # a broken driver: the load check will say more
            return None, f"torch.cuda.mem_get_info failed: {exc}"
        return int(free), "torch.cuda.mem_get_info"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "/proc/meminfo MemAvailable"
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    for name, source in (("SC_AVPHYS_PAGES", "available"), ("SC_PHYS_PAGES", "physical")):
        try:
            pages = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if pages > 0:
            return int(pages * page), f"sysconf {name} ({source} memory)"
    return None, "unknown"


def render_text(report: DoctorReport) -> str:
    """The report for people: one line per check (✓/✗ and its numbers),
    then the verdict."""
    span = f"[{report.layers[0]}, {report.layers[1]})"
    lines = [
        f"doctor: {report.model or '?'} layers {span} recipe {report.recipe} "
        f"on {report.backend or '?'}/{report.device or '?'}"
    ]
    for check in report.checks:
        numbers = ", ".join(f"{k}={_fmt(v)}" for k, v in check.details.items())
        mark = "✓" if check.ok else "✗"
        lines.append(f"  {mark} {check.name:<10} {numbers}")
        if not check.ok:
            lines.append(f"      {check.reason}: {check.message}")
    if report.admitted:
        lines.append(f"admitted in {report.duration_s:.2f} s (manifest {report.manifest_digest})")
    else:
        lines.append(f"refused at {report.failed_check}: {report.reason}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _execute(run: _Run, steps: list[tuple[str, Any]], mode: str) -> DoctorReport:
    began = time.perf_counter()
    checks: list[Check] = []
    failed: Check | None = None
    for name, step in steps:
        step_began = time.perf_counter()
        if run.progress is not None and name not in _OWN_PHASE:
            run.progress.phase(_PHASES.get(name, name))
        try:
            details = step(run)
        except _Refused as refusal:
            details = {**refusal.details, "seconds": time.perf_counter() - step_began}
            failed = Check(name, False, details, refusal.reason, refusal.message)
            checks.append(failed)
            break
        details["seconds"] = time.perf_counter() - step_began
        checks.append(Check(name, True, details))
    throughput = run.throughput
    return DoctorReport(
        admitted=failed is None,
        failed_check=failed.name if failed else None,
        reason=failed.reason if failed else None,
        message=failed.message if failed else None,
        checks=checks,
        manifest_digest=manifest_digest(run.manifest) if run.manifest else None,
        model=run.manifest["name"] if run.manifest else None,
        num_layers=run.manifest["num_layers"] if run.manifest else None,
        layers=[run.start, run.end],
        recipe=run.recipe_name,
        backend=run.backend,
        device=run.device,
        prefill_tok_s=throughput.prefill_tok_s if throughput else None,
        decode_tok_s=throughput.decode_tok_s if throughput else None,
        duration_s=time.perf_counter() - began,
        checked_at=time.time(),
        mode=mode,
    )


# --- the checks: each returns its details or raises _Refused ---------------------


_PHASES = {
    "tensors": "checking tensor digests",
    "load": "loading the shard",
    "probe": "probe forward pass",
    "throughput": "measuring throughput",
}
"""How the long checks read in progress lines; the others go by their name."""
_OWN_PHASE = frozenset({"tensors"})
"""Checks that open their phase themselves, once they know how many steps."""


def _check_backend_installed(run: _Run) -> dict[str, Any]:
    name = run.backend
    if name not in BACKENDS:
        raise _Refused(
            "backend_unknown", f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}"
        )
    if not backend_available(name):
        raise _Refused("backend_not_installed", f"backend {name} is not installed; {_hint(name)}")
    return {"backend": name}


def _hint(name: str) -> str:
    return f"install it with pip install 'shardmesh[runtime,{name}]'"


def _check_backend(run: _Run) -> dict[str, Any]:
    _check_backend_installed(run)
    name = run.backend
    assert name is not None
    hint = _hint(name)
    for module in REQUIRED_MODULES[name]:
        try:
            import_libraries(module)
        except ImportError as exc:
            raise _Refused(
                "backend_not_installed", f"backend {name}: import {module} failed ({exc}); {hint}"
            ) from None
    run.device = default_device(name)
    versions: dict[str, str | None] = {}
    for dist in _BACKEND_DISTRIBUTIONS[name]:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"backend": name, "device": run.device, "versions": versions}


def default_device(backend: str) -> str:
    """The device load_shard will put a `backend` shard on."""
    import_libraries(*REQUIRED_MODULES[backend], f"runtime.model.backends.{backend}_backend")
    if backend == "torch":
        from runtime.model.backends.torch_backend import default_device as torch_device

        return torch_device()
    import mlx.core as mx

    return str(mx.default_device().type.name)


def _check_manifest(run: _Run) -> dict[str, Any]:
    if not run.model_dir.is_dir():
        raise _Refused(
            "model_missing",
            f"{run.model_dir}: no such model folder; give the folder that holds "
            "config.json, the safetensors files and shardmesh-manifest.json",
        )
    if not (run.model_dir / MANIFEST_FILE).is_file():
        raise _Refused(
            "manifest_missing",
            f"{run.model_dir / MANIFEST_FILE}: no manifest; "
            f"run `shardmesh manifest build {run.model_dir}`",
        )
    try:
        manifest = load_manifest(run.model_dir)
    except ManifestError as exc:
        raise _Refused("manifest_invalid", str(exc)) from None
    try:
        run.config = read_config(run.model_dir)
    except ShardLoadError as exc:
        raise _Refused("model_invalid", str(exc)) from None
    config_sha = file_sha256(run.model_dir / "config.json")
    if config_sha != manifest["config_sha256"]:
        raise _Refused(
            "config_mismatch",
            "config.json differs from the one the manifest was built from",
            expected_sha256=manifest["config_sha256"],
            actual_sha256=config_sha,
        )
    for file_name, expected in sorted(manifest.get("tokenizer_files", {}).items()):
        path = run.model_dir / file_name
        actual = file_sha256(path) if path.is_file() else None
        if actual != expected:
            raise _Refused(
                "tokenizer_mismatch",
                f"tokenizer file {file_name} is {'changed' if actual else 'missing'}",
                file=file_name,
                expected_sha256=expected,
                actual_sha256=actual,
            )
    try:
        golden = load_golden(run.model_dir, manifest)
    except (ManifestError, KeyError, OSError, ValueError) as exc:
        raise _Refused("golden_invalid", f"golden activations unusable: {exc}") from None
    layers = run.config["num_hidden_layers"]
    probe = len(manifest["probe"]["token_ids"])
    if (
        len(golden.boundaries) != layers + 1
        or any(b.shape != (probe, run.config["hidden_size"]) for b in golden.boundaries)
        or golden.logits.shape != (probe, run.config["vocab_size"])
    ):
        raise _Refused(
            "golden_invalid",
            f"golden activations do not fit a {layers}-layer model and a {probe}-token probe",
            boundaries=len(golden.boundaries),
        )
    upper = np.triu(np.ones((layers + 1, layers + 1), dtype=bool), k=1)  # the spans a < b
    for recipe, errors in golden.calibration.items():
        if errors.shape != (layers + 1, layers + 1, probe) or not (
            np.isfinite(errors[upper]).all() and (errors[upper] >= 0).all()
        ):
            raise _Refused(
                "golden_invalid",
                f"calibration of {recipe} does not hold a finite error for every span and "
                f"probe token of a {layers}-layer model",
                recipe=recipe,
            )
    run.manifest = manifest
    run.golden = golden
    return {
        "model": manifest["name"],
        "architecture": manifest["architecture"],
        "num_layers": layers,
        "tensors": len(manifest["tensors"]),
        "probe_tokens": probe,
        "calibrated": sorted(r for r in golden.calibration if r in RECIPES),
        "manifest_digest": manifest_digest(manifest),
    }


def _check_span(run: _Run) -> dict[str, Any]:
    assert run.config is not None
    layers = run.config["num_hidden_layers"]
    if not 0 <= run.start < run.end <= layers:
        raise _Refused(
            "span_out_of_range",
            f"layer span [{run.start}, {run.end}) is not a non-empty part of the model's "
            f"{layers} layers [0, {layers})",
            start=run.start,
            end=run.end,
            num_layers=layers,
        )
    return {"start": run.start, "end": run.end, "num_layers": layers}


def _check_recipe(run: _Run) -> dict[str, Any]:
    assert run.backend is not None and run.device is not None
    _check_recipe_for_model(run)
    try:
        run.recipe = check_recipe(run.backend, run.recipe_name, run.device)
    except BackendError as exc:
        raise _Refused("recipe_unsupported", str(exc), recipe=run.recipe_name) from None
    return {"recipe": run.recipe.name, "dtype": run.recipe.dtype, "bits": run.recipe.bits}


def _check_recipe_for_model(run: _Run) -> dict[str, Any]:
    """The part of the recipe check that needs no device: whether the
    backend runs this recipe for this model's architecture at all."""
    assert run.config is not None and run.backend is not None
    refusal = recipe_refusal(run.config, run.backend, run.recipe_name)
    if refusal is not None:
        raise _Refused("recipe_unsupported", refusal, recipe=run.recipe_name)
    return {"recipe": run.recipe_name}


def _check_memory(run: _Run) -> dict[str, Any]:
    assert run.config is not None and run.device is not None
    shard_bytes = _stored_shard_bytes(run)
    required = int(shard_bytes * LOAD_PEAK_FACTOR)
    free, source = free_memory_bytes(run.device)
    details = {
        "shard_bytes": shard_bytes,
        "required_bytes": required,
        "free_bytes": free,
        "source": source,
    }
    if free is not None and free < required:
        raise _Refused(
            "insufficient_memory",
            f"{run.device} has {free} bytes free; loading the shard needs about {required}",
            **details,
        )
    return details


def _stored_shard_bytes(run: _Run) -> int:
    """Bytes of the shard's tensors as stored, from the safetensors headers
    only. A tensor absent from the files is skipped here: the `tensors`
    check names it."""
    assert run.config is not None
    reader = _open_reader(run)
    total = 0
    for name in tensor_names_for_shard(run.config, run.start, run.end):
        try:
            _path, begin, end = reader.byte_range(name)
        except ShardLoadError:
            continue
        total += end - begin
    return total


def _open_reader(run: _Run) -> SafetensorsReader:
    try:
        return SafetensorsReader(run.model_dir)
    except ShardLoadError as exc:
        raise _Refused("weights_unreadable", str(exc)) from None


def _check_tensors(run: _Run) -> dict[str, Any]:
    assert run.config is not None and run.manifest is not None
    listed = run.manifest["tensors"]
    reader = _open_reader(run)
    names = tensor_names_for_shard(run.config, run.start, run.end)
    for name in names:  # header-only checks first: no bytes read for a missing tensor
        if name not in listed:
            raise _Refused(
                "tensor_not_in_manifest", f"tensor {name} is not in the manifest", tensor=name
            )
        try:
            shape = list(reader.shape_of(name))
        except ShardLoadError as exc:
            raise _Refused("missing_tensor", str(exc), tensor=name) from None
        if shape != listed[name]["shape"]:
            raise _Refused(
                "shape_mismatch",
                f"tensor {name} has shape {shape}, the manifest says {listed[name]['shape']}",
                tensor=name,
            )
    if run.progress is not None:
        run.progress.phase(_PHASES["tensors"], len(names))
    for name in names:  # one tensor in memory at a time
        if run.progress is not None:
            run.progress.advance()
        try:
            raw = reader.read([name])[name]
        except ShardLoadError as exc:
            raise _Refused("weights_unreadable", str(exc), tensor=name) from None
        actual = hashlib.sha256(raw.data).hexdigest()
        expected = listed[name]["sha256"]
        if actual != expected or raw.dtype != listed[name]["dtype"]:
            raise _Refused(
                "digest_mismatch",
                f"tensor {name} does not match the manifest's digest",
                tensor=name,
                expected_sha256=expected,
                actual_sha256=actual,
            )
    return {"tensors": len(names), "bytes_hashed": reader.bytes_read}


def _check_load(run: _Run) -> dict[str, Any]:
    spec = ShardSpec(run.model_dir, run.start, run.end, run.recipe_name)
    try:
        run.shard = load_shard(spec, run.backend)
    except _ENVIRONMENT_ERRORS as exc:
        raise _Refused("load_failed", _describe(exc)) from None
    run.device = run.shard.device
    info = run.shard.info()
    return {
        "device": run.device,
        "weight_bytes": info.get("weight_bytes"),
        "bytes_read": info.get("bytes_read"),
    }


def _check_probe(run: _Run) -> dict[str, Any]:
    assert run.shard is not None and run.golden is not None
    assert run.manifest is not None and run.config is not None
    recipe = run.recipe or check_recipe(run.shard.name, run.recipe_name, run.shard.device)
    token_ids = np.asarray(run.manifest["probe"]["token_ids"], dtype=np.int64)
    positions = np.arange(len(token_ids), dtype=np.int64)
    inputs = token_ids if run.start == 0 else run.golden.boundaries[run.start]
    last = run.end == run.config["num_hidden_layers"]
    expected = run.golden.logits if last else run.golden.boundaries[run.end]
    calibration = run.golden.calibration.get(recipe.name)
    reference = None if calibration is None else calibration[run.start, run.end].astype(float)
    try:
        output = run.shard.forward(inputs, positions, run.shard.new_cache())
        # Calibrated: each token against its own reference error. Without
        # calibration: the one-number measure the recipe's tolerance bounds.
        if reference is None:
            errors = np.asarray([relative_error(output, expected)])
        else:
            errors = row_errors(output, expected)
    except _ENVIRONMENT_ERRORS as exc:
        raise _Refused("forward_failed", _describe(exc)) from None
    if reference is None:
        bounds = np.asarray([recipe.tolerance])
    else:
        bounds = calibrated_tolerance(recipe, reference)
    details: dict[str, Any] = {
        "input": "token_ids" if run.start == 0 else f"boundary {run.start}",
        "compared": "logits" if last else f"boundary {run.end}",
        "probe_tokens": len(token_ids),
        "basis": "recipe" if reference is None else "calibrated",
    }
    finite = bool(np.isfinite(errors).all())
    # The token nearest its bound (or the first blown-up one) speaks for the
    # probe: it is the one that admits or refuses the shard.
    worst = int(np.argmax(errors / bounds)) if finite else int(np.argmin(np.isfinite(errors)))
    error = float(errors[worst])
    tolerance = float(bounds[worst])
    # NaN/inf (a blown-up activation) cannot go into strict JSON; None with
    # the verdict below says it all.
    details["error"] = error if finite else None
    details["tolerance"] = tolerance
    if reference is not None:
        details["token"] = worst
        details["reference_error"] = float(reference[worst])
    if finite and (errors <= bounds).all():
        return details
    if reference is None:
        why = f"over the {recipe.name} tolerance {tolerance:g}"
    else:
        why = (
            f"on probe token {worst}, over its calibrated {recipe.name} tolerance "
            f"{tolerance:.3g} ({CALIBRATION_MARGIN:g} x this span's reference error "
            f"{details['reference_error']:.3g} + {recipe.calibration_floor:g})"
        )
    raise _Refused(
        "outputs_mismatch",
        f"probe output differs from the golden by {error:.3g} (relative), {why}",
        **details,
    )


def _check_throughput(run: _Run) -> dict[str, Any]:
    assert run.shard is not None
    try:
        run.throughput = measure_throughput(run.shard)
    except _ENVIRONMENT_ERRORS as exc:
        raise _Refused("forward_failed", _describe(exc)) from None
    return asdict(run.throughput)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, BackendError) else f"{type(exc).__name__}: {exc}"
