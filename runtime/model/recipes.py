"""Numeric recipes: how a shard's weights are stored and computed, and how
far its answers may drift from the fp32 golden activations.

A node picks a recipe (fp32, bf16, fp16, q8, q4) to fit its memory; the
doctor then compares its shard's probe output with the fp32 goldens. With
the manifest's calibration, each probe token's error must be within
`calibrated_tolerance` of the error an honest shard of that span showed
(`CALIBRATION_MARGIN` times it plus the recipe's floor): how far a recipe
drifts is a property of the model. Without it, `relative_error` is bounded
by `Recipe.tolerance`. `SUPPORT` says which backend runs which recipe on
which device; anything else is refused by `check_recipe`, never run in
another recipe. q8/q4 are MLX's affine group grid on both backends.

Why per model and per token, how the tolerances were set, and what each
backend runs: docs/design/recipes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.model.backends.base import BackendError

# MLX's default quantization group: one scale and one bias per 64 weights
# along the input dimension. Shared so both backends quantize alike.
QUANT_GROUP_SIZE = 64

# Guards the relative error against an all-zero golden (never seen in
# practice; it keeps the division defined).
_TINY = 1e-30


@dataclass(frozen=True, slots=True)
class Recipe:
    """A numeric recipe. `dtype` is the compute/storage dtype of unquantized
    tensors and activations; `bits` is set for weight-quantized recipes."""

    name: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    bits: int | None
    tolerance: float  # bound on relative_error vs the fp32 golden, uncalibrated
    description: str
    # Added to the calibrated bound of every token (see calibrated_tolerance):
    # about one rounding step of the recipe's coarsest quantity, what an
    # honest implementation other than the reference may err by where the
    # reference's own error happens to be ~0.
    calibration_floor: float


RECIPES: dict[str, Recipe] = {
    # fp32 against an fp32 golden differs only by summation order (threads,
    # kernels, devices): 0 measured on CPU, ~1e-6 expected on GPU kernels.
    # 1e-4 leaves room for those while one flipped exponent bit is orders
    # larger.
    # Calibration floor: the same 1e-4 (MLX's fp32 differs from the
    # reference by <= 6e-6 per token on SmolLM2-135M).
    "fp32": Recipe("fp32", "float32", None, 1e-4, "full precision", 1e-4),
    # float16 keeps 11 significant bits (unit roundoff 2^-11 ~ 4.9e-4) on
    # weights and activations; measured <= 1.3e-3 (torch, any span).
    # Calibration floor: two units of roundoff (MLX needs 4.5e-4 of it).
    "fp16": Recipe("fp16", "float16", None, 5e-3, "float16 weights and activations", 1e-3),
    # bfloat16 keeps 8 significant bits (2^-8 ~ 3.9e-3), 8x coarser than
    # fp16; measured <= 1.0e-2. Calibration floor: two units of roundoff
    # (MLX needs 2.1e-3 of it, on the tiny models).
    "bf16": Recipe("bf16", "bfloat16", None, 3e-2, "bfloat16 weights and activations", 8e-3),
    # 8-bit affine groups: step = group range / 255, so each weight is off
    # by at most ~0.2% of its group's range; measured <= 7.2e-3.
    # Calibration floor: half a step, 1/510 (MLX, whose rounding onto the
    # grid differs from torch's, needs 8.7e-4 of it).
    "q8": Recipe("q8", "float32", 8, 2.5e-2, "8-bit affine group-quantized weights", 2e-3),
    # 4-bit: step = range / 15, 17x coarser than q8; measured <= 0.155 on
    # the tiny models (random weights amplify error more than trained ones).
    # The bound is loose by necessity: on the tiny models q4's own noise is
    # of the order of one layer's contribution, so its doctor catches gross
    # errors (one layer's weights perturbed by noise of their own size gives
    # ~0.7; a flipped exponent bit, a wrong token: more) and leans on the
    # tensor digests for subtle ones. The other recipes catch noise of 10%
    # of the weights' size in one layer (~0.05). Calibration floor: half a
    # step, 1/30 (MLX needs none: on SmolLM2-135M q4's reference error is
    # >= 0.005 on every token of every span).
    "q4": Recipe("q4", "float32", 4, 0.4, "4-bit affine group-quantized weights", 3.3e-2),
}

ALL_RECIPES = frozenset(RECIPES)

# How far above this model's own reference error (per span, recipe and
# token) an honest shard may err. The reference is one implementation (the
# torch backend on CPU); another rounds differently — other kernels, fp32
# accumulation where the reference rounds to bfloat16, MLX's own q8/q4
# grid — and its error on one token is a fresh draw of the same size, not
# the same number. Measured on SmolLM2-135M (tests/runtime/model/test_pretrained.py):
# MLX's per-token errors reach 2.3x the reference's where that is not ~0
# (bf16, [0, 10); the floors take the tokens where it is), and every MLX
# shard, any recipe and span, stays within 0.66 of the bound 3x gives.
# Corruption the probe can see at all lands well above it: two swapped
# layers at 2.9x (bf16) to 670x (fp32) the bound, a layer perturbed by
# noise of its own size at 1.5x (q4 on [20, 30), the loosest) to 9000x.
# Twice would put MLX's q8 on [0, 30) at 0.95 of its bound; five times
# would admit that perturbed q4 shard.
CALIBRATION_MARGIN = 3.0


def calibrated_tolerance(recipe: Recipe, reference: np.ndarray) -> np.ndarray:
    """Per-token bounds for a span whose honest shard of `recipe` shows
    `reference` (its `row_errors`, from the manifest's calibration)."""
    return CALIBRATION_MARGIN * reference + recipe.calibration_floor


# backend -> device kind -> recipes it runs. Device kinds: the device string
# up to any ":index" ("cuda:1" -> "cuda").
SUPPORT: dict[str, dict[str, frozenset[str]]] = {
    "torch": {"cpu": ALL_RECIPES, "cuda": ALL_RECIPES, "mps": ALL_RECIPES},
    "mlx": {"gpu": ALL_RECIPES, "cpu": ALL_RECIPES},
}


def get_recipe(name: str) -> Recipe:
    """The recipe called `name`, or a BackendError listing the valid ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise BackendError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}") from None


def check_recipe(backend_name: str, recipe: str, device: str) -> Recipe:
    """The recipe, if `backend_name` can run it on `device`; otherwise a
    BackendError saying what is not supported and what is."""
    found = get_recipe(recipe)
    devices = SUPPORT.get(backend_name)
    if devices is None:
        raise BackendError(f"unknown backend {backend_name!r}; choose one of {', '.join(SUPPORT)}")
    kind = device.split(":", 1)[0]
    supported = devices.get(kind)
    if supported is None:
        raise BackendError(f"backend {backend_name} does not run on device {device!r}")
    if recipe not in supported:
        raise BackendError(
            f"backend {backend_name} on {kind} cannot run recipe {recipe}; "
            f"it runs {', '.join(r for r in RECIPES if r in supported)}"
        )
    return found


def relative_error(output: np.ndarray, golden: np.ndarray) -> float:
    """max |output - golden| / max |golden|: the worst element's error on
    the scale of the activations. The max (not a mean) is what catches one
    corrupted weight, which spoils a few channels and leaves the rest
    exact; normalising by the golden's range makes one bound serve hidden
    states and logits of any model."""
    if output.shape != golden.shape:
        raise BackendError(f"output shape {output.shape} differs from golden {golden.shape}")
    diff = np.abs(output.astype(np.float64) - golden.astype(np.float64))
    return float(diff.max() / max(float(np.abs(golden).max()), _TINY))


def row_errors(output: np.ndarray, golden: np.ndarray) -> np.ndarray:
    """Per token t (row): max_c |output - golden|[t, c] / max_c |golden[t, c]|,
    each token's worst element on that token's own scale. A massive
    activation lives in one token's row (the attention sink), so it sets
    the scale of that row only and the other tokens stay visible."""
    if output.shape != golden.shape:
        raise BackendError(f"output shape {output.shape} differs from golden {golden.shape}")
    diff = np.abs(output.astype(np.float64) - golden.astype(np.float64))
    scale = np.maximum(np.abs(golden.astype(np.float64)).max(axis=1), _TINY)
    return diff.max(axis=1) / scale
