"""Whether a swarm member's manifest describes the model in a local folder.

A volunteer's copy of a model the swarm already serves should take the
swarm's manifest rather than build one: a manifest built here would name the
folder (another identity for the same weights), and building costs the
golden pass and calibration. A member may lie, so its manifest is used only
when config.json, every tokenizer file and the checkpoint's tensors (names,
and given `tensor_table` their dtype, shape and sha256) match the files here.
The caller checks the digest the serving members sign and the goldens' hash.

More: docs/design/doctor.md#a-members-manifest-for-a-local-folder.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any, Final

from runtime.model.manifest import ManifestError, checked_manifest, file_sha256, tokenizer_digests
from runtime.model.weights import CONFIG_FILE, architecture, read_config

MAX_NAMED: Final = 3
"""How many differing tensors or files a refusal names: enough to see a
pattern (one layer, or all of them), short enough for one log line."""


def manifest_mismatch(
    manifest: Any, model_dir: Path, tensors: dict[str, Any] | Collection[str]
) -> str | None:
    """Why `manifest` does not describe the model in `model_dir`, or None
    when it does. `tensors` is the folder's `tensor_table` (dtype, shape and
    sha256 of each tensor), or only the tensors' names when the weights are
    not all on disk. The folder's config.json must be readable
    (`runtime.model.weights.read_config`)."""
    try:
        manifest = checked_manifest(manifest, "the manifest")
    except ManifestError as exc:
        return str(exc)
    if manifest["config_sha256"] != file_sha256(Path(model_dir) / CONFIG_FILE):
        return f"its {CONFIG_FILE} is not this folder's"
    config = read_config(Path(model_dir))
    geometry = {
        "architecture": architecture(config),
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
    }
    wrong = [key for key, value in geometry.items() if manifest[key] != value]
    if wrong:
        return f"its {', '.join(wrong)} disagree with {CONFIG_FILE}"
    theirs = manifest.get("tokenizer_files")
    if not isinstance(theirs, dict):
        return "its tokenizer table is not an object"
    ours = tokenizer_digests(Path(model_dir))
    if theirs != ours:
        differ = sorted(n for n in set(ours) | set(theirs) if theirs.get(n) != ours.get(n))
        return f"tokenizer files differ: {_some(differ)}"
    listed = manifest["tensors"]
    if not isinstance(listed, dict):
        return "its tensor table is not an object"
    if set(listed) != set(tensors):
        unlisted, absent = sorted(set(tensors) - set(listed)), sorted(set(listed) - set(tensors))
        return (
            f"it lists other tensors than this checkpoint's (not listed: {_some(unlisted)}; "
            f"not here: {_some(absent)})"
        )
    if isinstance(tensors, dict):
        differ = sorted(name for name, info in tensors.items() if listed[name] != info)
        if differ:
            return f"tensors differ from this folder's: {_some(differ)}"
    return None


def _some(names: list[str]) -> str:
    if not names:
        return "none"
    more = len(names) - MAX_NAMED
    return ", ".join(names[:MAX_NAMED]) + (f" and {more} more" if more > 0 else "")
