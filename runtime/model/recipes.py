"""Numeric recipes: how a shard's weights are stored and computed, and how
far its answers may drift from the fp32 golden activations.

A node chooses a recipe to fit its memory; the doctor then runs the
manifest's probe through the node's shard and compares the result with the
fp32 golden activations. `Recipe.tolerance` is the bound on
`relative_error(output, golden)` (defined below) for the doctor to admit the
shard. The bounds are set about 3x above the worst error measured with the
torch backend on tiny models (seeds 0-2, both families, spans from one
layer to the whole model, where per-layer errors compound) —
tight enough that one corrupted weight or a perturbed layer fails, loose
enough that an honest node never does.

Backends (the only place the two backend authors coordinate):
- MLX runs all five natively: fp32/bf16/fp16 as array dtypes, q8/q4 with
  `mlx.nn.quantize` (affine, group size 64, bits 8/4).
- torch runs fp32/bf16/fp16 as module dtypes on CPU, CUDA and MPS (fp16
  matmul works on CPU since torch 2.1). For q8/q4 it uses the same affine
  group quantization as MLX (group 64, a scale and a bias per group, weights
  stored as packed integers and dequantized inside each matmul), written in
  plain torch ops in runtime/model/backends/torch_backend.py. Why not a library:
  `torch.ao.quantization` is deprecated and warns of its removal;
  `torchao`'s int4 kernels are CUDA-specific and each release pins a torch
  minor, which would tie our pinned CPU wheel to it. Plain ops run on every
  device torch runs on and quantize weights onto the same grid as MLX, so
  the two backends' q8/q4 errors are alike. The cost is speed (no integer
  kernels), not correctness or memory: weights stay stored at 8 or 4 bits.
A combination missing from `SUPPORT` is refused by `check_recipe`, never
silently run in another recipe.
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
    tolerance: float  # bound on relative_error vs the fp32 golden
    description: str


RECIPES: dict[str, Recipe] = {
    # fp32 against an fp32 golden differs only by summation order (threads,
    # kernels, devices): 0 measured on CPU, ~1e-6 expected on GPU kernels.
    # 1e-4 leaves room for those while one flipped exponent bit is orders
    # larger.
    "fp32": Recipe("fp32", "float32", None, 1e-4, "full precision"),
    # float16 keeps 11 significant bits (unit roundoff 2^-11 ~ 4.9e-4) on
    # weights and activations; measured <= 1.3e-3 (torch, any span).
    "fp16": Recipe("fp16", "float16", None, 5e-3, "float16 weights and activations"),
    # bfloat16 keeps 8 significant bits (2^-8 ~ 3.9e-3), 8x coarser than
    # fp16; measured <= 1.0e-2.
    "bf16": Recipe("bf16", "bfloat16", None, 3e-2, "bfloat16 weights and activations"),
    # 8-bit affine groups: step = group range / 255, so each weight is off
    # by at most ~0.2% of its group's range; measured <= 7.2e-3.
    "q8": Recipe("q8", "float32", 8, 2.5e-2, "8-bit affine group-quantized weights"),
    # 4-bit: step = range / 15, 17x coarser than q8; measured <= 0.155 on
    # the tiny models (random weights amplify error more than trained ones).
    # The bound is loose by necessity: on the tiny models q4's own noise is
    # of the order of one layer's contribution, so its doctor catches gross
    # errors (one layer's weights perturbed by noise of their own size gives
    # ~0.7; a flipped exponent bit, a wrong token: more) and leans on the
    # tensor digests for subtle ones. The other recipes catch noise of 10%
    # of the weights' size in one layer (~0.05).
    "q4": Recipe("q4", "float32", 4, 0.4, "4-bit affine group-quantized weights"),
}

ALL_RECIPES = frozenset(RECIPES)

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
