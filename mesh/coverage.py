"""The coverage map: which layers of which model the swarm can serve right now.

Per `(model, manifest_digest, recipe_class)` it lists the nodes whose doctor
admitted their shard in a still-valid report, merges their layer spans, and
reports the gaps and every layer's replicas; route finding, the placement
policy and the HTTP API read it. Nodes without a valid admission, and nodes
the ledger holds quarantined, are left out (`CoverageMap.excluded` says
why). Two digests under one name are never merged into one chain
(`CoverageMap.for_model` lists the variants, best first). Pure: the caller
passes the members, their records, `now` and who is quarantined.

More: docs/design/routes.md#the-coverage-map.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from mesh.identity import node_id_text
from mesh.member_table import LIVE_STATES, MEMBER_STATES
from mesh.records import MAX_LAYER_INDEX, CapabilityReport, NodeRecord

RECIPE_CLASSES: Mapping[str, str] = {
    "fp32": "fp32",
    "bf16": "half",
    "fp16": "half",
    "q8": "q8",
    "q4": "q4",
}
"""Recipe -> recipe class. Within a class the activations two shards exchange
are close enough that a bf16 shard may feed an fp16 one (both 16-bit floats
with doctor tolerances of the same order); across classes the numeric error
compounds differently and output quality changes, so a route stays inside one
class and coverage is counted per class."""

RECIPE_CLASS_ORDER: tuple[str, ...] = ("fp32", "half", "q8", "q4")
"""Most to least precise; breaks ties when choosing a model's primary variant."""

CLOCK_SKEW_ALLOWANCE_S = 30.0
"""A report validated up to this far in our future still counts. Volunteers'
clocks are not all NTP-disciplined and drift by seconds; 30 s absorbs that
while a report claiming a validation time well ahead of us (a broken clock)
is excluded as `not_yet_valid`. Expiry gets no allowance: a stale report must
not keep a node routable."""

ExclusionReason = Literal[
    "no_capability", "failed", "expired", "not_yet_valid", "dead", "mismatch", "quarantined"
]


class CoverageKey(NamedTuple):
    """What one coverage entry is about; reports under one key can be chained."""

    model: str
    manifest_digest: str
    recipe_class: str


@dataclass(frozen=True, slots=True)
class ServingNode:
    """A node in a coverage entry, with what route finding needs to cost it."""

    node_id: bytes
    state: str
    layers: tuple[int, int]
    recipe: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class ModelCoverage:
    """Coverage of one model variant over `[0, num_layers)`.

    `covered` and `gaps` are sorted, merged, half-open spans that together
    tile `[0, num_layers)`; `replicas[i]` is how many serving nodes hold
    layer `i`. `complete` means a route over every layer exists.
    """

    model: str
    manifest_digest: str
    recipe_class: str
    num_layers: int
    covered: tuple[tuple[int, int], ...]
    gaps: tuple[tuple[int, int], ...]
    replicas: tuple[int, ...]
    nodes: tuple[ServingNode, ...]
    complete: bool

    @property
    def key(self) -> CoverageKey:
        return CoverageKey(self.model, self.manifest_digest, self.recipe_class)


@dataclass(frozen=True, slots=True)
class CoverageMap:
    """Every model variant seen in some capability report, and who was left out.

    A variant appears even when none of its nodes serves (all dead or
    expired): then it is all gap, which is what the status API and the
    placement policy need to see.
    """

    models: Mapping[CoverageKey, ModelCoverage]
    excluded: Mapping[bytes, str]

    def for_model(self, model: str) -> list[ModelCoverage]:
        """Every variant of `model`, the one best able to serve first."""
        return sorted(
            (entry for key, entry in self.models.items() if key.model == model), key=_rank
        )

    def best(self, model: str) -> ModelCoverage | None:
        """The variant a request for `model` would be routed over, if any."""
        variants = self.for_model(model)
        return variants[0] if variants else None


def _rank(entry: ModelCoverage) -> tuple[Any, ...]:
    """Complete first, then most layers covered, then the thinnest layer best
    replicated, then precision, then digest so the order is total."""
    covered = sum(end - start for start, end in entry.covered)
    thinnest = min(entry.replicas, default=0)
    return (
        not entry.complete,
        -covered,
        -thinnest,
        RECIPE_CLASS_ORDER.index(entry.recipe_class),
        entry.manifest_digest,
    )


def recipe_class(recipe: str) -> str:
    """The class a recipe's activations are interchangeable within."""
    try:
        return RECIPE_CLASSES[recipe]
    except KeyError:
        raise ValueError(f"unknown recipe {recipe!r}") from None


def _exclusion(
    state: str,
    record: NodeRecord | None,
    now: float,
    num_layers: Mapping[str, int] | None,
    quarantined: bool,
) -> ExclusionReason | None:
    """Why this node does not serve, or None when it does. A live node's
    quarantine comes before anything its report says: it is what the
    node's operator must hear of, and it holds whatever the report is."""
    if state not in LIVE_STATES:
        return "dead"
    if quarantined:
        return "quarantined"
    capability = None if record is None else record.capability
    if record is None or capability is None:
        return "no_capability"
    if capability.result != "admitted":
        return "failed"
    if capability.validated_at > now + CLOCK_SKEW_ALLOWANCE_S:
        return "not_yet_valid"
    if capability.expires_at <= now:
        return "expired"
    if not _consistent(record, capability, num_layers):
        return "mismatch"
    return None


def _consistent(
    record: NodeRecord, capability: CapabilityReport, num_layers: Mapping[str, int] | None
) -> bool:
    """The report is about what the node is assigned and runs, within the model.

    A report for another shard, recipe or backend than the node now has was
    made before a reassignment or restart; it proves nothing about what the
    node would compute now.
    """
    assignment = record.assignment
    if assignment is not None and (
        assignment.model != capability.model
        or assignment.layers != capability.layers
        or assignment.recipe != capability.recipe
    ):
        return False
    if record.backend is not None and record.backend.kind != capability.backend:
        return False
    if num_layers is not None and capability.model in num_layers:
        return capability.layers[1] <= num_layers[capability.model]
    return True


def _spans(replicas: list[int], covered: bool) -> tuple[tuple[int, int], ...]:
    """Maximal runs of layers with (covered) or without (not covered) replicas."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for index, count in enumerate(replicas):
        if (count > 0) == covered:
            if start is None:
                start = index
        elif start is not None:
            spans.append((start, index))
            start = None
    if start is not None:
        spans.append((start, len(replicas)))
    return tuple(spans)


def _model_coverage(key: CoverageKey, length: int, nodes: list[ServingNode]) -> ModelCoverage:
    # Difference array: O(nodes + layers) rather than O(nodes * layers).
    delta = [0] * (length + 1)
    for node in nodes:
        start, end = node.layers
        delta[start] += 1
        delta[end] -= 1
    replicas: list[int] = []
    running = 0
    for index in range(length):
        running += delta[index]
        replicas.append(running)
    gaps = _spans(replicas, covered=False)
    return ModelCoverage(
        model=key.model,
        manifest_digest=key.manifest_digest,
        recipe_class=key.recipe_class,
        num_layers=length,
        covered=_spans(replicas, covered=True),
        gaps=gaps,
        replicas=tuple(replicas),
        nodes=tuple(sorted(nodes, key=lambda node: (node.layers, node.node_id))),
        complete=length > 0 and not gaps,
    )


def build_coverage(
    entries: Iterable[tuple[bytes, str, NodeRecord | None]],
    now: float,
    num_layers: Mapping[str, int] | None = None,
    *,
    quarantined: Collection[bytes] = (),
) -> CoverageMap:
    """Build the coverage map from `(node_id, member state, record)` entries.

    A node serves a variant when it is alive or suspect, not `quarantined`
    (the nodes the ledger holds quarantined at `now`: a proven liar's report
    proves nothing, so it is excluded as `quarantined` and no route uses
    it), and its capability report is admitted, validated no later than
    `now` plus the skew allowance, unexpired at `now`, and agrees with its
    assignment and backend.

    `num_layers` gives a model's layer count where the caller knows it (from
    its manifest). Otherwise it is the largest `num_layers` any report for that
    model and digest states (reports carry it from their manifest), or failing
    that the largest layer end reported, served or not, so a dead last shard
    still shows as a gap at the end.

    Raises ValueError for an unknown member state or a node listed twice
    (it would be counted as two replicas).
    """
    if num_layers is not None:
        for model, length in num_layers.items():
            if isinstance(length, bool) or not isinstance(length, int):
                raise ValueError(f"num_layers[{model!r}] must be an integer")
            if not 0 < length <= MAX_LAYER_INDEX:
                raise ValueError(
                    f"num_layers[{model!r}]={length} is outside [1, {MAX_LAYER_INDEX}]"
                )
    seen: set[bytes] = set()
    excluded: dict[bytes, str] = {}
    serving: dict[CoverageKey, list[ServingNode]] = {}
    inferred: dict[tuple[str, str], int] = {}
    for node_id, state, record in entries:
        if state not in MEMBER_STATES:
            raise ValueError(f"unknown member state {state!r}")
        if node_id in seen:
            raise ValueError(f"node {node_id_text(node_id)} is listed twice")
        seen.add(node_id)
        capability = None if record is None else record.capability
        key: CoverageKey | None = None
        if capability is not None:
            key = CoverageKey(
                capability.model, capability.manifest_digest, recipe_class(capability.recipe)
            )
            identity = (capability.model, capability.manifest_digest)
            length = capability.num_layers or capability.layers[1]
            inferred[identity] = max(inferred.get(identity, 0), length)
            serving.setdefault(key, [])
        reason = _exclusion(state, record, now, num_layers, node_id in quarantined)
        if reason is not None:
            excluded[node_id] = reason
            continue
        assert key is not None and capability is not None  # no exclusion => a report
        serving[key].append(
            ServingNode(
                node_id=node_id,
                state=state,
                layers=capability.layers,
                recipe=capability.recipe,
                prefill_tokens_per_s=capability.prefill_tokens_per_s,
                decode_tokens_per_s=capability.decode_tokens_per_s,
            )
        )
    models: dict[CoverageKey, ModelCoverage] = {}
    for key, nodes in serving.items():
        if num_layers is not None and key.model in num_layers:
            length = num_layers[key.model]
        else:
            length = inferred[(key.model, key.manifest_digest)]
        models[key] = _model_coverage(key, length, nodes)
    return CoverageMap(models=models, excluded=excluded)


# --- JSON view --------------------------------------------------------------


def _entry_json(entry: ModelCoverage) -> dict[str, Any]:
    return {
        "layers": entry.num_layers,
        "covered": [[start, end] for start, end in entry.covered],
        "gaps": [[start, end] for start, end in entry.gaps],
        "replicas": list(entry.replicas),
        "complete": entry.complete,
        "recipe_class": entry.recipe_class,
        "manifest_digest": entry.manifest_digest,
        "nodes": [
            {
                "node_id": node_id_text(node.node_id),
                "state": node.state,
                "layers": [node.layers[0], node.layers[1]],
                "recipe": node.recipe,
                "prefill_tokens_per_s": node.prefill_tokens_per_s,
                "decode_tokens_per_s": node.decode_tokens_per_s,
            }
            for node in entry.nodes
        ],
    }


def coverage_to_json(coverage: CoverageMap) -> dict[str, Any]:
    """The `coverage` field of `/v1/network/status`, keyed by model name.

    Each model's fields describe its best variant (see `CoverageMap.best`),
    so a reader that knows only the contract's `layers`, `covered`, `gaps`
    and `replicas` sees what a request would be routed over. Other variants
    of the same name (another recipe class, or a disagreeing manifest digest)
    are listed, best first and in the same shape, under `"alternatives"`,
    which is empty when there is only one.
    """
    names = sorted({key.model for key in coverage.models})
    view: dict[str, Any] = {}
    for name in names:
        primary, *others = coverage.for_model(name)
        view[name] = {**_entry_json(primary), "alternatives": [_entry_json(e) for e in others]}
    return view


def excluded_to_json(coverage: CoverageMap) -> dict[str, str]:
    """Why each non-serving node is not in the map, keyed by hex node id."""
    return {node_id_text(node_id): reason for node_id, reason in sorted(coverage.excluded.items())}
