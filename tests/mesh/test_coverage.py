"""Coverage map: who serves which layers, the gaps, and the replica counts."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.coverage import (
    CLOCK_SKEW_ALLOWANCE_S,
    CoverageKey,
    build_coverage,
    coverage_to_json,
    excluded_to_json,
    recipe_class,
)
from mesh.records import (
    Addresses,
    Assignment,
    BackendInfo,
    CapabilityReport,
    NodeRecord,
)

NOW = 10_000.0
DIGEST = "aa" * 32
OTHER_DIGEST = "bb" * 32
MODEL = "qwen3-8l"


def nid(index: int) -> bytes:
    return index.to_bytes(32, "big")


def record(
    layers: tuple[int, int] | None,
    *,
    recipe: str = "bf16",
    result: str = "admitted",
    validated_at: float = NOW - 60,
    expires_at: float = NOW + 600,
    model: str = MODEL,
    digest: str = DIGEST,
    assigned: tuple[int, int] | None = None,
    backend: str = "torch",
    decode: float = 50.0,
) -> NodeRecord:
    """A node record; `layers=None` means no capability report at all."""
    capability = None
    if layers is not None:
        capability = CapabilityReport(
            result=result,  # type: ignore[arg-type]
            model=model,
            manifest_digest=digest,
            layers=layers,
            recipe=recipe,  # type: ignore[arg-type]
            backend=backend,  # type: ignore[arg-type]
            prefill_tokens_per_s=1000.0,
            decode_tokens_per_s=decode,
            validated_at=validated_at,
            expires_at=expires_at,
            failure=None if result == "admitted" else "probe mismatch",
        )
    assignment = None
    if assigned is not None:
        assignment = Assignment(model, assigned, recipe, "operator", False, 1)  # type: ignore[arg-type]
    return NodeRecord(
        addresses=Addresses("tcp://n:1", "tcp://n:2"),
        started_at=0.0,
        backend=BackendInfo("torch", "cpu", 2**30),
        assignment=assignment,
        capability=capability,
    )


def three_nodes() -> list[tuple[bytes, str, NodeRecord | None]]:
    return [
        (nid(1), "alive", record((0, 3), assigned=(0, 3))),
        (nid(2), "alive", record((3, 6), assigned=(3, 6))),
        (nid(3), "alive", record((6, 8), assigned=(6, 8))),
    ]


def only(cmap: Any) -> Any:
    assert len(cmap.models) == 1
    return next(iter(cmap.models.values()))


# --- basics -----------------------------------------------------------------


def test_three_shards_cover_the_model() -> None:
    entry = only(build_coverage(three_nodes(), NOW))
    assert entry.key == CoverageKey(MODEL, DIGEST, "half")
    assert entry.num_layers == 8
    assert entry.covered == ((0, 8),)
    assert entry.gaps == ()
    assert entry.replicas == (1,) * 8
    assert entry.complete
    assert [node.node_id for node in entry.nodes] == [nid(1), nid(2), nid(3)]
    assert entry.nodes[0].layers == (0, 3)
    assert entry.nodes[0].decode_tokens_per_s == 50.0


@pytest.mark.parametrize("state", ["dead", "left"])
def test_a_dead_node_opens_a_gap(state: str) -> None:
    entries = three_nodes()
    entries[1] = (nid(2), state, entries[1][2])
    cmap = build_coverage(entries, NOW)
    entry = only(cmap)
    assert entry.covered == ((0, 3), (6, 8))
    assert entry.gaps == ((3, 6),)
    assert entry.replicas == (1, 1, 1, 0, 0, 0, 1, 1)
    assert not entry.complete
    assert cmap.excluded == {nid(2): "dead"}


def test_a_dead_last_shard_still_shows_as_a_gap_at_the_end() -> None:
    """Without num_layers, L comes from every report, served or not."""
    entries = three_nodes()
    entries[2] = (nid(3), "dead", entries[2][2])
    entry = only(build_coverage(entries, NOW))
    assert entry.num_layers == 8
    assert entry.gaps == ((6, 8),)


def test_suspect_nodes_still_serve() -> None:
    entries = three_nodes()
    entries[0] = (nid(1), "suspect", entries[0][2])
    cmap = build_coverage(entries, NOW)
    entry = only(cmap)
    assert entry.complete
    assert entry.nodes[0].state == "suspect"
    assert cmap.excluded == {}


@pytest.mark.parametrize(
    ("node_record", "reason"),
    [
        (None, "no_capability"),
        (record(None), "no_capability"),
        (record((3, 6), result="failed"), "failed"),
        (record((3, 6), expires_at=NOW), "expired"),
        (record((3, 6), validated_at=NOW - 700, expires_at=NOW - 1), "expired"),
        (
            record((3, 6), validated_at=NOW + CLOCK_SKEW_ALLOWANCE_S + 1, expires_at=NOW + 900),
            "not_yet_valid",
        ),
        (record((3, 6), assigned=(3, 7)), "mismatch"),
        (record((3, 6), backend="mlx"), "mismatch"),
    ],
)
def test_unroutable_nodes_are_excluded_with_a_reason(
    node_record: NodeRecord | None, reason: str
) -> None:
    entries = three_nodes()
    entries[1] = (nid(2), "alive", node_record)
    cmap = build_coverage(entries, NOW)
    assert cmap.excluded == {nid(2): reason}
    entry = only(cmap)
    assert entry.gaps == ((3, 6),)
    assert nid(2) not in {node.node_id for node in entry.nodes}


def test_a_quarantined_node_serves_nothing_whatever_its_report_says() -> None:
    """Its admitted, unexpired report is a liar's: no route may use it."""
    cmap = build_coverage(three_nodes(), NOW, quarantined={nid(2)})
    assert cmap.excluded == {nid(2): "quarantined"}
    entry = only(cmap)
    assert entry.gaps == ((3, 6),) and not entry.complete
    assert nid(2) not in {node.node_id for node in entry.nodes}
    assert excluded_to_json(cmap) == {nid(2).hex(): "quarantined"}


def test_quarantine_outranks_a_bad_report_but_not_death() -> None:
    entries = three_nodes()
    entries[0] = (nid(1), "alive", record((0, 3), result="failed"))
    entries[2] = (nid(3), "dead", entries[2][2])
    cmap = build_coverage(entries, NOW, quarantined=[nid(1), nid(3)])
    assert cmap.excluded == {nid(1): "quarantined", nid(3): "dead"}


def test_a_quarantined_node_that_is_not_a_member_changes_nothing() -> None:
    cmap = build_coverage(three_nodes(), NOW, quarantined={nid(9)})
    assert cmap.excluded == {} and only(cmap).complete


def test_mismatched_recipe_or_model_is_excluded() -> None:
    bad_recipe = record((3, 6), recipe="fp16")
    assert bad_recipe.capability is not None
    mismatched = NodeRecord(
        addresses=bad_recipe.addresses,
        started_at=0.0,
        assignment=Assignment(MODEL, (3, 6), "bf16", "operator", False, 1),
        capability=bad_recipe.capability,
    )
    other_model = NodeRecord(
        addresses=bad_recipe.addresses,
        started_at=0.0,
        assignment=Assignment("llama", (3, 6), "fp16", "operator", False, 1),
        capability=bad_recipe.capability,
    )
    cmap = build_coverage([(nid(1), "alive", mismatched), (nid(2), "alive", other_model)], NOW)
    assert cmap.excluded == {nid(1): "mismatch", nid(2): "mismatch"}


def test_report_validated_slightly_in_the_future_counts() -> None:
    entries = [(nid(1), "alive", record((0, 8), validated_at=NOW + CLOCK_SKEW_ALLOWANCE_S))]
    assert only(build_coverage(entries, NOW)).complete


def test_node_without_assignment_is_judged_by_its_report() -> None:
    entry = only(build_coverage([(nid(1), "alive", record((0, 8)))], NOW))
    assert entry.complete


def test_replicas_are_counted() -> None:
    entries = [
        (nid(1), "alive", record((0, 4))),
        (nid(2), "alive", record((0, 4))),
        (nid(3), "alive", record((2, 8))),
        (nid(4), "suspect", record((7, 8))),
    ]
    entry = only(build_coverage(entries, NOW))
    assert entry.replicas == (2, 2, 3, 3, 1, 1, 1, 2)
    assert entry.covered == ((0, 8),)
    assert entry.complete


def test_known_layer_count_exposes_a_missing_tail() -> None:
    entries = three_nodes()[:2]
    entry = only(build_coverage(entries, NOW, num_layers={MODEL: 8}))
    assert entry.num_layers == 8
    assert entry.gaps == ((6, 8),)
    # Without the count, the map can only see up to the last report.
    assert only(build_coverage(entries, NOW)).complete


def test_report_beyond_the_known_layer_count_is_a_mismatch() -> None:
    entries = three_nodes()
    cmap = build_coverage(entries, NOW, num_layers={MODEL: 7})
    assert cmap.excluded == {nid(3): "mismatch"}
    assert only(cmap).gaps == ((6, 7),)


# --- recipe classes and digests ---------------------------------------------


def test_recipe_classes() -> None:
    assert recipe_class("fp32") == "fp32"
    assert recipe_class("bf16") == recipe_class("fp16") == "half"
    assert recipe_class("q8") == "q8"
    assert recipe_class("q4") == "q4"
    with pytest.raises(ValueError):
        recipe_class("int3")


def test_half_precision_recipes_chain_together_but_not_with_q4() -> None:
    entries = [
        (nid(1), "alive", record((0, 4), recipe="bf16")),
        (nid(2), "alive", record((4, 8), recipe="fp16")),
        (nid(3), "alive", record((0, 4), recipe="q4")),
    ]
    cmap = build_coverage(entries, NOW)
    half = cmap.models[CoverageKey(MODEL, DIGEST, "half")]
    q4 = cmap.models[CoverageKey(MODEL, DIGEST, "q4")]
    assert half.complete
    assert not q4.complete
    assert q4.num_layers == 8  # layer count is shared by every class of a digest
    assert q4.gaps == ((4, 8),)
    assert cmap.best(MODEL) == half


def test_disagreeing_digests_are_kept_apart() -> None:
    entries = [
        (nid(1), "alive", record((0, 4))),
        (nid(2), "alive", record((4, 8), digest=OTHER_DIGEST)),
        (nid(3), "alive", record((4, 8))),
    ]
    cmap = build_coverage(entries, NOW)
    ours = cmap.models[CoverageKey(MODEL, DIGEST, "half")]
    theirs = cmap.models[CoverageKey(MODEL, OTHER_DIGEST, "half")]
    assert ours.complete
    assert theirs.gaps == ((0, 4),)
    assert [entry.manifest_digest for entry in cmap.for_model(MODEL)] == [DIGEST, OTHER_DIGEST]


def test_a_model_with_no_serving_node_is_all_gap() -> None:
    entries = [(nid(1), "dead", record((0, 8))), (nid(2), "alive", record((0, 8), result="failed"))]
    entry = only(build_coverage(entries, NOW))
    assert entry.nodes == ()
    assert entry.gaps == ((0, 8),)
    assert entry.replicas == (0,) * 8
    assert not entry.complete


def test_unknown_model_has_no_entry() -> None:
    cmap = build_coverage(three_nodes(), NOW)
    assert cmap.for_model("llama") == []
    assert cmap.best("llama") is None


# --- caller errors ----------------------------------------------------------


def test_a_node_listed_twice_is_refused() -> None:
    entries = [*three_nodes(), (nid(1), "alive", record((0, 3)))]
    with pytest.raises(ValueError, match="twice"):
        build_coverage(entries, NOW)


def test_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError, match="state"):
        build_coverage([(nid(1), "zombie", record((0, 8)))], NOW)


@pytest.mark.parametrize("length", [0, -3, 10_001])
def test_bad_layer_count_is_refused(length: int) -> None:
    with pytest.raises(ValueError):
        build_coverage(three_nodes(), NOW, num_layers={MODEL: length})


# --- JSON -------------------------------------------------------------------


def test_json_shape() -> None:
    entries = three_nodes()
    entries.append((nid(4), "alive", record((0, 8), recipe="q4")))
    entries.append((nid(5), "dead", record((0, 8))))
    cmap = build_coverage(entries, NOW)
    view = coverage_to_json(cmap)
    assert json.loads(json.dumps(view)) == view
    assert list(view) == [MODEL]
    top = view[MODEL]
    # half has 3 nodes but q4 also completes with one; ties broken by precision.
    assert top["recipe_class"] == "half"
    assert top["layers"] == 8
    assert top["covered"] == [[0, 8]]
    assert top["gaps"] == []
    assert top["replicas"] == [1] * 8
    assert top["complete"] is True
    assert top["manifest_digest"] == DIGEST
    assert top["nodes"][0] == {
        "node_id": nid(1).hex(),
        "state": "alive",
        "layers": [0, 3],
        "recipe": "bf16",
        "prefill_tokens_per_s": 1000.0,
        "decode_tokens_per_s": 50.0,
    }
    [alternative] = top["alternatives"]
    assert alternative["recipe_class"] == "q4"
    assert alternative["covered"] == [[0, 8]]
    assert "alternatives" not in alternative
    assert excluded_to_json(cmap) == {nid(5).hex(): "dead"}


def test_json_primary_is_the_complete_variant() -> None:
    entries = [
        (nid(1), "alive", record((0, 4), recipe="fp32")),
        (nid(2), "alive", record((0, 8), recipe="q8")),
    ]
    view = coverage_to_json(build_coverage(entries, NOW))
    assert view[MODEL]["recipe_class"] == "q8"
    assert view[MODEL]["alternatives"][0]["gaps"] == [[4, 8]]


# --- properties -------------------------------------------------------------

STATES = ["alive", "suspect", "dead", "left"]


@st.composite
def swarms(draw: st.DrawFn) -> tuple[int, list[tuple[bytes, str, NodeRecord | None]]]:
    length = draw(st.integers(1, 40))
    count = draw(st.integers(0, 30))
    entries: list[tuple[bytes, str, NodeRecord | None]] = []
    for index in range(count):
        start = draw(st.integers(0, length - 1))
        end = draw(st.integers(start + 1, length))
        state = draw(st.sampled_from(STATES))
        kind = draw(st.sampled_from(["ok", "ok", "failed", "expired", "none"]))
        node_record = {
            "ok": lambda s=start, e=end: record((s, e)),
            "failed": lambda s=start, e=end: record((s, e), result="failed"),
            "expired": lambda s=start, e=end: record((s, e), expires_at=NOW - 1),
            "none": lambda s=start, e=end: None,
        }[kind]()
        entries.append((nid(index), state, node_record))
    return length, entries


@settings(max_examples=300)
@given(swarms())
def test_covered_and_gaps_tile_the_model(
    swarm: tuple[int, list[tuple[bytes, str, NodeRecord | None]]],
) -> None:
    length, entries = swarm
    cmap = build_coverage(entries, NOW, num_layers={MODEL: length})
    serving = [
        node_record.capability.layers
        for _, state, node_record in entries
        if state in ("alive", "suspect")
        and node_record is not None
        and node_record.capability is not None
        and node_record.capability.result == "admitted"
        and node_record.capability.expires_at > NOW
    ]
    assert len(cmap.excluded) == len(entries) - len(serving)
    if not cmap.models:
        assert all(node_record is None for _, _, node_record in entries)
        return
    entry = only(cmap)
    assert entry.num_layers == length
    spans = sorted(entry.covered + entry.gaps)
    # Together they tile [0, L) with no overlap and no hole.
    assert spans[0][0] == 0
    assert spans[-1][1] == length
    for (_, end), (start, _) in pairwise(spans):
        assert end == start
    assert all(start < end for start, end in spans)
    # Merged: no two covered spans touch, nor two gaps.
    for group in (entry.covered, entry.gaps):
        for (_, end), (start, _) in pairwise(group):
            assert end < start
    in_covered = {i for start, end in entry.covered for i in range(start, end)}
    assert len(entry.replicas) == length
    for layer, replicas in enumerate(entry.replicas):
        assert (replicas > 0) == (layer in in_covered)
        assert replicas == sum(start <= layer < end for start, end in serving)
    assert entry.complete == (entry.gaps == ())
    assert len(entry.nodes) == len(serving)


def test_a_thousand_nodes() -> None:
    entries: list[tuple[bytes, str, NodeRecord | None]] = []
    for index in range(1000):
        start = (index * 7) % 80
        state = "dead" if index % 10 == 3 else "alive"
        entries.append((nid(index), state, record((start, start + 8), decode=float(index))))
    cmap = build_coverage(entries, NOW)
    entry = only(cmap)
    assert entry.num_layers == 87
    assert entry.complete
    assert len(entry.nodes) == 900
    assert sum(entry.replicas) == 900 * 8
    assert len(cmap.excluded) == 100
