"""Model manifests: a model's identity in the swarm and its known answers.

`shardmesh-manifest.json` in a model folder records what the model *is*
(architecture, geometry, sha256 of config.json, the tokenizer files and
every tensor) and what it *computes*: fp32 golden activations of a fixed
probe at every layer boundary, in `shardmesh-golden.safetensors` beside it,
with each recipe's calibration (the error an honest shard of every span
shows, token by token). `manifest_digest` names the model in records, the
coverage map and the ledger; the calibration stays out of it, so a model
keeps one identity across builders. Goldens are computed layer by layer on
the torch backend in fp32, so building needs memory for one layer.

The file layout, why every span is calibrated, and the cost:
docs/design/doctor.md#the-manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model.architectures import embedding_scale, recipe_refusal
from runtime.model.backends.base import BackendError, ShardSpec
from runtime.model.progress import Progress
from runtime.model.recipes import RECIPES, row_errors
from runtime.model.weights import SafetensorsReader, architecture, read_config

MANIFEST_FILE = "shardmesh-manifest.json"
GOLDEN_FILE = "shardmesh-golden.safetensors"
MANIFEST_FORMAT = "shardmesh-manifest/1"

# Files whose bytes decide how text becomes token ids (or back); any that
# exist are digested. generation_config.json is not among them: it changes
# sampling defaults, not the model's identity.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def has_chat_template(folder: Path) -> bool:
    """Whether the model in `folder` has a chat template: transformers'
    own file for it, or the `chat_template` of its tokenizer config."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


# The probe: 8 tokens, enough for attention to mix positions (a 1-token
# probe would not test the causal mask or rotary embedding) yet cheap on
# any model. Ids are derived from a fixed seed string so every manifest
# builder picks the same ones for a given vocabulary size.
PROBE_LENGTH = 8
PROBE_SEED = b"shardmesh probe v1"

# Golden-file tensor name of a recipe's calibration matrix, after the prefix.
_CALIBRATION_PREFIX = "calibration."

_REQUIRED_KEYS = (
    "format",
    "name",
    "architecture",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "config_sha256",
    "tokenizer_sha256",
    "tensors",
    "probe",
    "golden",
)


class ManifestError(BackendError):
    """A manifest is missing, malformed, or does not match its files."""


@dataclass(frozen=True, slots=True)
class Golden:
    """The fp32 known answers for the probe, and the error honest shards of
    each calibrated recipe show against them."""

    boundaries: list[np.ndarray]  # L+1 arrays [P, hidden]; boundary i = input of layer i
    logits: np.ndarray  # [P, vocab]
    # recipe -> [L+1, L+1, P]; entry [a, b, t] (a < b) is span [a, b)'s
    # reference error on token t. Empty for a manifest built before
    # calibration existed.
    calibration: dict[str, np.ndarray] = field(default_factory=dict)


def probe_token_ids(vocab_size: int) -> list[int]:
    """The fixed probe for a vocabulary of `vocab_size` tokens."""
    ids = []
    for i in range(PROBE_LENGTH):
        digest = hashlib.sha256(PROBE_SEED + i.to_bytes(4, "little")).digest()
        ids.append(int.from_bytes(digest[:8], "little") % vocab_size)
    return ids


def build_manifest(
    model_dir: Path,
    name: str | None = None,
    progress: Progress | None = None,
    tensors: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compute the manifest and goldens of `model_dir`, write both files
    there, and return the manifest. `name` defaults to the name in an
    existing manifest (so a rebuild keeps a tiny model's --name), else the
    directory's name. The goldens' file holds the calibration too
    (`compute_calibration`). `progress` hears of each phase. `tensors` is
    the folder's `tensor_table` when the caller has hashed it already."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    if name is None:
        try:
            name = load_manifest(model_dir)["name"]
        except ManifestError:
            name = model_dir.resolve().name
    if tensors is None:
        tensors = tensor_table(model_dir, progress)
    token_ids = probe_token_ids(config["vocab_size"])
    golden = compute_golden(model_dir, token_ids, progress)
    golden = Golden(
        golden.boundaries,
        golden.logits,
        compute_calibration(model_dir, golden, token_ids, progress),
    )
    golden_sha = _write_golden(model_dir / GOLDEN_FILE, golden)
    tokenizer_files = tokenizer_digests(model_dir)
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": name,
        "architecture": architecture(config),
        "model_type": config.get("model_type"),
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
        "config_sha256": file_sha256(model_dir / "config.json"),
        "tokenizer_files": tokenizer_files,
        "tokenizer_sha256": _canonical_sha256(tokenizer_files),
        "tensors": tensors,
        "probe": {"token_ids": token_ids, "positions": list(range(len(token_ids)))},
        "golden": {
            "file": GOLDEN_FILE,
            "sha256": golden_sha,
            "dtype": "float32",
            "boundaries": len(golden.boundaries),
        },
    }
    _atomic_write(model_dir / MANIFEST_FILE, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def tensor_table(model_dir: Path, progress: Progress | None = None) -> dict[str, Any]:
    """The manifest's `tensors`: every tensor's dtype, shape and sha256,
    hashed one tensor in memory at a time."""
    reader = SafetensorsReader(model_dir)
    tensors = {}
    names = reader.names()
    if progress:
        progress.phase("hashing tensors", len(names))
    for tensor_name in names:
        raw = reader.read([tensor_name])[tensor_name]
        tensors[tensor_name] = {
            "dtype": raw.dtype,
            "shape": list(raw.shape),
            "sha256": hashlib.sha256(raw.data).hexdigest(),
        }
        if progress:
            progress.advance()
    return tensors


def tokenizer_digests(model_dir: Path) -> dict[str, str]:
    """The manifest's `tokenizer_files`: the sha256 of each tokenizer file
    the folder has."""
    return {f: file_sha256(model_dir / f) for f in TOKENIZER_FILES if (model_dir / f).exists()}


def compute_golden(
    model_dir: Path, token_ids: list[int], progress: Progress | None = None
) -> Golden:
    """fp32 activations of the probe at every boundary, one layer at a time."""
    from runtime.model.backends.torch_backend import load_torch_shard

    config = read_config(model_dir)
    layers = config["num_hidden_layers"]
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.arange(len(ids), dtype=np.int64)
    embed = SafetensorsReader(model_dir).read(["model.embed_tokens.weight"])
    inputs = embed["model.embed_tokens.weight"].to_numpy().astype(np.float32)[ids]
    del embed
    scale = embedding_scale(config)
    if scale is not None:  # Gemma: layer 0's input is the scaled embedding
        inputs = inputs * np.float32(scale)
    boundaries = [inputs]
    hidden: np.ndarray = ids
    logits = None
    if progress:
        progress.phase("golden activations, layer by layer", layers)
    for i in range(layers):
        shard = load_torch_shard(ShardSpec(model_dir, i, i + 1, "fp32"), device="cpu")
        hidden = shard.forward(hidden, positions, shard.new_cache(), apply_head=False)
        boundaries.append(hidden)
        if shard.is_last:
            logits = shard.head(hidden)
        del shard
        if progress:
            progress.advance()
    assert logits is not None
    return Golden(boundaries, logits)


def compute_calibration(
    model_dir: Path,
    golden: Golden,
    token_ids: list[int],
    progress: Progress | None = None,
) -> dict[str, np.ndarray]:
    """The reference error of every span in every recipe: per recipe a
    [L+1, L+1, P] float32 array, entry [a, b, t] the `row_errors` of shard
    [a, b) on probe token t, NaN where a >= b.

    One pass per recipe, one layer in memory at a time: when layer i is
    loaded, every chain that started at a boundary a <= i (from the token
    ids when a = 0, else from golden boundary a, as the doctor feeds a
    shard) runs through it, and each chain's output is scored at boundary
    i+1. Chaining one-layer shards computes what one shard [a, b) computes:
    between layers the hidden state is cast to float32 and back, which is
    exact for fp16 and bf16 values and a no-op for the float32 recipes.

    A recipe the reference does not run for this model (q8/q4 of a
    mixture of experts, `architectures.recipe_refusal`) is left out: the
    doctor then holds another backend's shards of it to the recipe's
    global tolerance."""
    from runtime.model.backends.torch_backend import load_torch_shard

    config = read_config(model_dir)
    layers = config["num_hidden_layers"]
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.arange(len(ids), dtype=np.int64)
    calibration = {}
    for recipe in RECIPES:
        if recipe_refusal(config, "torch", recipe) is not None:
            continue
        if progress:
            progress.phase(f"calibrating {recipe}: reference error of every span", layers)
        errors = np.full((layers + 1, layers + 1, len(ids)), np.nan, dtype=np.float32)
        chains: dict[int, np.ndarray] = {}  # start boundary -> hidden state after layer i
        for i in range(layers):
            shard = load_torch_shard(ShardSpec(model_dir, i, i + 1, recipe), device="cpu")
            chains[i] = ids if i == 0 else golden.boundaries[i]
            for start, hidden in chains.items():
                chains[start] = shard.forward(
                    hidden, positions, shard.new_cache(), apply_head=False
                )
            if shard.is_last:
                # One head call for all chains, not L: the final norm and
                # the LM head treat rows independently, and the head is the
                # model's largest matmul (vocabulary x hidden).
                starts = list(chains)
                logits = shard.head(np.concatenate([chains[a] for a in starts]))
                for a, rows in zip(starts, np.split(logits, len(starts)), strict=True):
                    errors[a, layers] = row_errors(rows, golden.logits)
            else:
                for a, hidden in chains.items():
                    errors[a, i + 1] = row_errors(hidden, golden.boundaries[i + 1])
            del shard
            if progress:
                progress.advance()
        calibration[recipe] = errors
    return calibration


def load_manifest(model_dir: Path) -> dict[str, Any]:
    """The manifest of `model_dir`, checked for shape (not yet against the
    files: the doctor does that)."""
    path = Path(model_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: no manifest; run `shardmesh manifest build {model_dir}`"
        ) from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: unreadable manifest: {exc}") from exc
    return checked_manifest(manifest, path)


def checked_manifest(manifest: Any, where: Path | str) -> dict[str, Any]:
    """`manifest` (parsed JSON, from a file or a peer) if it has a
    manifest's format and keys; ManifestError naming `where` otherwise."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"{where}: manifest is not a JSON object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ManifestError(
            f"{where}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in manifest]
    if missing:
        raise ManifestError(f"{where}: manifest lacks {', '.join(missing)}")
    return manifest


def load_golden(model_dir: Path, manifest: dict[str, Any]) -> Golden:
    """The goldens the manifest references, refused if their digest differs."""
    from safetensors.numpy import load_file

    path = Path(model_dir) / manifest["golden"]["file"]
    if not path.exists():
        raise ManifestError(f"{path}: golden activations file is missing")
    if file_sha256(path) != manifest["golden"]["sha256"]:
        raise ManifestError(f"{path}: golden activations do not match the manifest's digest")
    arrays = load_file(str(path))
    count = manifest["golden"]["boundaries"]
    calibration = {
        name.removeprefix(_CALIBRATION_PREFIX): array
        for name, array in arrays.items()
        if name.startswith(_CALIBRATION_PREFIX)
    }
    return Golden([arrays[f"boundary.{i}"] for i in range(count)], arrays["logits"], calibration)


def install_manifest(model_dir: Path, manifest: dict[str, Any], golden: bytes) -> None:
    """Write a manifest obtained elsewhere (a swarm member's) and its golden
    file into `model_dir`: the goldens first, refused unless they hash as
    the manifest says, the manifest last, so the folder never holds a
    manifest without its goldens."""
    model_dir = Path(model_dir)
    checked_manifest(manifest, "the manifest to install")
    named = manifest["golden"]
    if not isinstance(named, dict) or named.get("file") != GOLDEN_FILE:
        raise ManifestError(f"the manifest's golden activations are not in {GOLDEN_FILE}")
    if hashlib.sha256(golden).hexdigest() != named.get("sha256"):
        raise ManifestError("the golden activations do not hash as the manifest says")
    _atomic_write(model_dir / GOLDEN_FILE, golden)
    _atomic_write(model_dir / MANIFEST_FILE, (json.dumps(manifest, indent=1) + "\n").encode())


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON: the model's swarm identity.

    The goldens' own digest is left out: goldens are derived from the
    weights, config and probe, which the digest already covers, and their
    last bits depend on the CPU that computed them (SIMD width, summation
    order). Leaving them out keeps one model one identity on every machine
    that builds its manifest."""
    identity = dict(manifest)
    identity["golden"] = {k: v for k, v in manifest["golden"].items() if k != "sha256"}
    return _canonical_sha256(identity)


def artifact_files(model_dir: Path) -> list[str]:
    """The files besides the manifest that an entry node needs to speak a
    model's language (tokenize, apply the chat template, know its context
    window), all covered by the manifest digest: config.json and the
    tokenizer files. The weights are not among them."""
    return ["config.json", *sorted(load_manifest(model_dir)["tokenizer_files"])]


def verify_artifacts(model_dir: Path, digest: str) -> None:
    """ManifestError unless `model_dir` holds a manifest whose digest is
    `digest` and config and tokenizer files that hash as it says: what an
    entry checks on files fetched from a peer before trusting them."""
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    if manifest_digest(manifest) != digest:
        raise ManifestError(f"{model_dir}: manifest digest is not {digest}")
    expected = {"config.json": manifest["config_sha256"], **manifest["tokenizer_files"]}
    for name, sha in expected.items():
        path = model_dir / name
        if not path.is_file() or file_sha256(path) != sha:
            raise ManifestError(f"{path}: missing or not the file the manifest names")


def _canonical_sha256(obj: Any) -> str:
    # Sorted keys, no whitespace, ASCII: one byte string per manifest on any
    # machine. The manifest holds no floats, so there is no float formatting
    # to disagree on.
    encoded = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()


def _write_golden(path: Path, golden: Golden) -> str:
    from safetensors.numpy import save

    arrays = {f"boundary.{i}": np.ascontiguousarray(b) for i, b in enumerate(golden.boundaries)}
    arrays["logits"] = np.ascontiguousarray(golden.logits)
    for recipe, errors in golden.calibration.items():
        arrays[_CALIBRATION_PREFIX + recipe] = np.ascontiguousarray(errors)
    data = save(arrays, metadata={"format": MANIFEST_FORMAT})
    _atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read a block at a time (weights run to gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
