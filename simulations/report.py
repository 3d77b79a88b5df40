"""Plots of a simulation run: what the swarm believed, and what it sent, over time.

The metrics say *how much*; the plots say *when*. A membership run draws
``membership`` (suspect and dead pairs, faults marked), ``traffic`` and
``spread``; a placement run draws ``placement`` (requests, who could commit,
each model's served fraction) and ``verification`` (correct answers, each
liar's first lie and quarantine). Each figure is PNG, SVG and PDF with its
series beside it as CSV. Plotting runs the same events as a plain run, so
the trace digest is unchanged. Each figure, track by track:
docs/design/simulator.md; how to get them: docs/simulation.md.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from simulations.cluster import MembershipCluster
from simulations.placement_cluster import PlacementCluster

SAMPLE_STEP_S: Final = 1.0
"""Virtual seconds per traffic sample: a 600 s run gives 600 points, enough
to see a one-probe-period burst (1 s on the LAN profile) and few enough that
sampling costs nothing beside the run."""
MAX_SAMPLES: Final = 2_000
"""A long run samples less often, so a plot never has more points than
pixels across."""
FIGURE_SIZE_IN: Final = (9.0, 4.0)
FIGURE_DPI: Final = 200
"""Sharp enough to print at the figure's size; the SVG and PDF scale freely."""
FORMATS: Final = ("png", "svg", "pdf")
VERIFY_BIN_S: Final = 10.0
"""Seconds per point of the served-correct fraction. Liars are caught within
tens of seconds, so a wider bin would smear a dip and the recovery after a
quarantine into one step; at tens of requests a minute a bin still holds
several answers (a bin with none is a gap in the line)."""
SERVED_BIN_S: Final = 10.0
"""Seconds per point of a model's served fraction. A chain lost to a crash
stays lost for the detection and the dead grace, tens of seconds, so a wider
bin would blur where an outage starts and ends; at tens of requests a minute
a bin still holds several (a bin with none is a gap in the line)."""
PLACEMENT_TRACKS: Final = (3.0, 1.0, 1.5)
"""Heights of the placement figure's tracks (demand, leader, availability):
demand keeps the usual figure's height; a leader track needs a row per voter
and no more; availability a 0-1 fraction with room to read it."""
LEADERLESS_COLOUR: Final = "tab:red"
LIAR_COLOURS: Final = ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink")
"""One per liar, in turn: its first lie and its quarantine share a colour,
none of them the served-correct line's blue."""


def plots_unavailable() -> str | None:
    """Why plots cannot be drawn here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install 'shardmesh[plots]'"
    return None


@dataclass
class Samples:
    """Traffic per step: each list has one value per step, ending at `times`."""

    step: float
    times: list[float] = field(default_factory=list)
    mean_messages: list[float] = field(default_factory=list)
    max_messages: list[float] = field(default_factory=list)
    mean_bytes: list[float] = field(default_factory=list)
    max_bytes: list[float] = field(default_factory=list)


def sample_step(duration: float) -> float:
    """The step for a run of `duration` seconds (see SAMPLE_STEP_S, MAX_SAMPLES)."""
    return max(SAMPLE_STEP_S, duration / MAX_SAMPLES)


def run_sampled(cluster: MembershipCluster, until: float, step: float) -> Samples:
    """Run `cluster` to `until` in steps of `step`, sampling its traffic."""
    samples = Samples(step)
    start = cluster.now
    # Boundaries by multiplication, not by adding `step` up: a sum drifts
    # (250 additions of 0.08 fall short of 20.0) and would add a sliver of
    # a last sample.
    count = int(-(-(until - start) // step)) if until > start else 0  # exact ceil
    for k in range(1, count + 1):
        mark = cluster.traffic_mark()
        cluster.run_until(until if k == count else min(until, start + k * step))
        traffic = cluster.traffic(mark)
        samples.times.append(cluster.now)
        samples.mean_messages.append(traffic["messages_per_node_second"])
        samples.max_messages.append(traffic["max_messages_per_node_second"])
        samples.mean_bytes.append(traffic["bytes_per_node_second"])
        samples.max_bytes.append(traffic["max_bytes_per_node_second"])
    return samples


def beliefs(
    verdicts: Iterable[tuple[float, int, str, int, int]],
) -> tuple[list[float], list[int], list[int]]:
    """(times, suspect, dead): after each verdict, how many (observer,
    subject) pairs hold the subject suspect, and dead. A later verdict about
    the same pair replaces the earlier one; "left" counts as neither."""
    state: dict[tuple[int, int], str] = {}
    counts = {"suspect": 0, "dead": 0}
    times: list[float] = []
    suspect: list[int] = []
    dead: list[int] = []
    for at, observer, kind, subject, _ in verdicts:
        pair = (observer, subject)
        before = state.get(pair)
        if before in counts:
            counts[before] -= 1
        state[pair] = kind
        if kind in counts:
            counts[kind] += 1
        if times and times[-1] == at:  # one point per instant: its final counts
            suspect[-1], dead[-1] = counts["suspect"], counts["dead"]
            continue
        times.append(at)
        suspect.append(counts["suspect"])
        dead.append(counts["dead"])
    return times, suspect, dead


def write_plots(cluster: MembershipCluster, samples: Samples, out: Path) -> list[Path]:
    """Write the three figures (see the module doc) into `out`, each in
    every format with its data as CSV; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, draw in (
        ("membership", _draw_membership),
        ("traffic", _draw_traffic),
        ("spread", _draw_spread),
    ):
        with _figure(out, name, written) as axes:
            header, rows = draw(axes, cluster, samples)
        written.append(_write_csv(out / f"{name}.csv", header, rows))
    return written


Rows = tuple[list[str], list[list[Any]]]
"""A figure's data: column names and rows, written as CSV beside it."""


@contextlib.contextmanager
def _figure(
    out: Path, name: str, written: list[Path], heights: Sequence[float] = (1.0,)
) -> Iterator[Any]:
    """Axes to draw on, one track per entry of `heights`: one track, the
    axes; more, a column of axes over one time axis, the first track as tall
    as a one-track figure. On exit, the figure saved as `name` in every
    format."""
    import matplotlib  # see plots_unavailable

    matplotlib.use("Agg")  # files only: never open a window
    matplotlib.rcParams["svg.hashsalt"] = "shardmesh"  # stable SVG ids, run to run
    from matplotlib import pyplot

    width, height = FIGURE_SIZE_IN
    figure, axes = pyplot.subplots(
        len(heights),
        figsize=(width, height * sum(heights) / heights[0]),
        dpi=FIGURE_DPI,
        sharex=True,
        gridspec_kw={"height_ratios": heights},
    )
    try:
        yield axes
        figure.tight_layout()
        for suffix in FORMATS:
            path = out / f"{name}.{suffix}"
            # No timestamps in the files: the same run draws the same bytes.
            figure.savefig(path, metadata=_METADATA.get(suffix))
            written.append(path)
    finally:
        pyplot.close(figure)


_METADATA: Final[dict[str, dict[str, Any]]] = {
    "png": {"Software": None},
    "svg": {"Date": None},
    "pdf": {"CreationDate": None},
}


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_placement_plot(cluster: PlacementCluster, out: Path) -> Path:
    """`placement`, three tracks over time: per model, requests and those
    served, with the placement commands that changed what serves it; the
    voter that could commit (`PlacementCluster.committing_leader`), with
    term changes marked and leaderless spans shaded; per model, its served
    fraction per `SERVED_BIN_S`, with the spans from its first request on
    that it had no complete chain shaded (what `incomplete_chain_s` sums).
    In every format, with `placement.csv` in long form, one row per
    `request` (value: served, 1 or 0), `leader` span (voter, empty where
    none could commit, and the highest term), `chain` span of every model
    from t = 0 (value: complete, 1 or 0) and `served_fraction` bin (empty
    where no request came)."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    models = sorted({model for _, model, _ in cluster.requests})
    with _figure(out, "placement", written, PLACEMENT_TRACKS) as (demand, leaders, availability):
        colours = _draw_demand(demand, cluster, models)
        leader_rows = _draw_leaders(leaders, cluster)
        served_rows = _draw_availability(availability, cluster, models, colours)
        availability.set_xlim(0, cluster.now)
        availability.set_xlabel("virtual seconds")
    rows: list[list[Any]] = [["request", at, at, model, "", "", int(ok)]
                             for at, model, ok in cluster.requests]  # fmt: skip
    rows += leader_rows
    rows += [["chain", start, end, model, "", "", int(ok)]
             for model in sorted(cluster.models)
             for start, end, ok in cluster.chain_spans(model)]  # fmt: skip
    rows += served_rows
    header = ["series", "start_s", "end_s", "model", "voter", "term", "value"]
    _write_csv(out / "placement.csv", header, rows)
    return out / "placement.png"


def _once(seen: set[str], label: str) -> str | None:
    """`label` the first time it is drawn, None after: each kind of line,
    span or marker appears once in its legend."""
    if label in seen:
        return None
    seen.add(label)
    return label


def _draw_demand(axes: Any, cluster: PlacementCluster, models: Sequence[str]) -> dict[str, str]:
    """Cumulative requests and served per model, placement commits marked;
    each model's colour, for the other tracks."""
    colours = {}
    for model in models:
        times = [at for at, name, _ in cluster.requests if name == model]
        served = list(itertools.accumulate(
            int(ok) for _, name, ok in cluster.requests if name == model
        ))  # fmt: skip
        line = axes.step(times, range(1, len(times) + 1), where="post",
                         label=f"{model}: requests")  # fmt: skip
        colours[model] = line[0].get_color()
        axes.step(times, served, where="post", linestyle="--",
                  color=colours[model], label=f"{model}: served")  # fmt: skip
    styles = {"Assign": "tab:green", "Release": "tab:grey", "MarkAdmissionFailed": "tab:red"}
    seen: set[str] = set()
    for at, kind, _ in cluster.commits:
        axes.axvline(at, color=styles.get(kind, "black"), linewidth=0.7, linestyle=":",
                     label=_once(seen, f"{kind} committed"))  # fmt: skip
    axes.set_ylabel("chat requests, cumulative")
    axes.set_title(f"demand placement, {len(cluster.workers)} workers, seed {cluster.seed}")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return colours


def _draw_leaders(axes: Any, cluster: PlacementCluster) -> list[list[Any]]:
    """The voter that could commit, term changes and leaderless spans (with
    a marker where each begins: a failover lasts a fraction of a second,
    too thin a span to see on minutes of run); its CSV rows."""
    spans = cluster.leader_spans()
    seen: set[str] = set()
    voters = len(cluster.ledgers)
    for number, (start, end, voter, term) in enumerate(spans):
        if voter is None:
            axes.axvspan(start, end, color=LEADERLESS_COLOUR, alpha=0.25, linewidth=0,
                         label=_once(seen, "no leader that could commit"))  # fmt: skip
            axes.plot([start], [voters - 0.5], marker="v", color=LEADERLESS_COLOUR,
                      linestyle="none", clip_on=False,
                      label=_once(seen, "leaderless span begins"))  # fmt: skip
        else:
            axes.hlines(voter, start, end, color="tab:blue", linewidth=4,
                        label=_once(seen, "leader that could commit"))  # fmt: skip
        if number and term != spans[number - 1][3]:
            axes.axvline(start, color="grey", linewidth=0.7, linestyle=":",
                         label=_once(seen, "term change"))  # fmt: skip
    axes.set_ylim(-0.5, voters - 0.5)
    axes.set_yticks(range(voters))
    axes.set_ylabel("leading voter")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return [["leader", start, end, "", "" if voter is None else voter, term, ""]
            for start, end, voter, term in spans]  # fmt: skip


def _draw_availability(
    axes: Any, cluster: PlacementCluster, models: Sequence[str], colours: dict[str, str]
) -> list[list[Any]]:
    """Per model, its served fraction per bin and the spans from its first
    request on without a complete chain; the bins' CSV rows."""
    rows: list[list[Any]] = []
    seen: set[str] = set()
    for model in models:
        colour = colours[model]
        since = cluster.stats[model].first_request_at
        assert since is not None  # it has requests
        for start, end, ok in cluster.chain_spans(model):
            if not ok and end > since:
                label = _once(seen, f"{model}: no complete chain")
                axes.axvspan(max(start, since), end, color=colour, alpha=0.15, hatch="//",
                             linewidth=0, label=label)  # fmt: skip
        answers = [(at, ok) for at, name, ok in cluster.requests if name == model]
        bins = served_correct(answers, SERVED_BIN_S, cluster.now)
        starts = [start for start, _, _ in bins]
        fractions = [served / count if count else math.nan for _, count, served in bins]
        axes.step([*starts, starts[-1] + SERVED_BIN_S], [*fractions, fractions[-1]], where="post",
                  color=colour, label=f"{model}: served, per {SERVED_BIN_S:g} s")  # fmt: skip
        rows += [["served_fraction", start, min(start + SERVED_BIN_S, cluster.now), model, "", "",
                  "" if math.isnan(fraction) else fraction]
                 for start, fraction in zip(starts, fractions, strict=True)]  # fmt: skip
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("fraction served")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return rows


def served_correct(
    answers: Sequence[tuple[float, bool]], step: float, end: float
) -> list[tuple[float, int, int]]:
    """(start, served, correct) for each bin of `step` seconds from 0 to
    `end`, over (time, correct) answers."""
    count = max(1, math.ceil(end / step))
    served, correct = [0] * count, [0] * count
    for at, ok in answers:
        index = min(int(at // step), count - 1)
        served[index] += 1
        correct[index] += ok
    return [(i * step, served[i], correct[i]) for i in range(count)]


def write_verification_plot(cluster: PlacementCluster, out: Path) -> Path:
    """`verification`: per `VERIFY_BIN_S`, the fraction of served answers
    that were correct (a gap where none was served), with each liar's first
    lie (dotted) and quarantine (solid) marked; in every format, with
    `verification.csv` (each bin: start, served, correct)."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    bins = served_correct(cluster.answers, VERIFY_BIN_S, cluster.now)
    with _figure(out, "verification", written) as axes:
        starts = [start for start, _, _ in bins]
        fractions = [correct / served if served else math.nan for _, served, correct in bins]
        axes.step([*starts, starts[-1] + VERIFY_BIN_S], [*fractions, fractions[-1]],
                  where="post", label="served answers correct")  # fmt: skip
        colours = itertools.cycle(LIAR_COLOURS)
        for index, stats in sorted(cluster.liars.items()):
            colour = next(colours)
            if stats.first_lie_at is not None:
                axes.axvline(stats.first_lie_at, color=colour, linewidth=0.8, linestyle=":",
                             label=f"worker {index} first lies")  # fmt: skip
            quarantined = cluster.quarantined_at.get(index)
            if quarantined is not None:
                axes.axvline(quarantined, color=colour, linewidth=1.2,
                             label=f"worker {index} quarantined")  # fmt: skip
        axes.set_xlim(0, cluster.now)
        axes.set_ylim(0, 1.02)
        axes.set_xlabel("virtual seconds")
        axes.set_ylabel(f"fraction correct, per {VERIFY_BIN_S:g} s")
        fraction = cluster.policy.verify_fraction
        axes.set_title(f"spot checks of {fraction:g} of answers, {len(cluster.liars)} liars, "
                       f"seed {cluster.seed}")  # fmt: skip
        axes.legend(loc="lower right")
    rows = [list(row) for row in bins]
    _write_csv(out / "verification.csv", ["time_s", "served", "correct"], rows)
    return out / "verification.png"


def _draw_membership(axes: Any, cluster: MembershipCluster, samples: Samples) -> Rows:
    times, suspect, dead = beliefs(cluster.verdicts())
    pairs = max(1, cluster.n * (cluster.n - 1))
    suspect_f = [count / pairs for count in suspect]
    dead_f = [count / pairs for count in dead]
    end = cluster.now
    # Step plots from t = 0 to the end, so a flat tail shows as flat.
    axes.step([0.0, *times, end], [0, *suspect_f, suspect_f[-1] if suspect else 0],
              where="post", label="believed suspect")  # fmt: skip
    axes.step([0.0, *times, end], [0, *dead_f, dead_f[-1] if dead else 0],
              where="post", label="believed dead")  # fmt: skip
    _mark_faults(axes, cluster)
    axes.set_xlim(0, end)
    axes.set_xlabel("virtual seconds")
    axes.set_ylabel(f"fraction of the {pairs:,} (observer, subject) pairs")
    axes.set_title(f"membership beliefs, {cluster.n} nodes, seed {cluster.seed}")
    axes.legend(loc="upper right")
    rows = [list(row) for row in zip(times, suspect, dead, suspect_f, dead_f, strict=True)]
    return ["time_s", "suspect_pairs", "dead_pairs", "suspect_fraction", "dead_fraction"], rows


def _draw_traffic(axes: Any, cluster: MembershipCluster, samples: Samples) -> Rows:
    axes.step(samples.times, samples.mean_messages, where="pre", label="messages, mean node")
    axes.step(samples.times, samples.max_messages, where="pre", label="messages, busiest node")
    axes.set_ylabel("messages per node-second")
    if any(samples.max_bytes):
        kib = axes.twinx()
        kib.step(samples.times, [b / 1024 for b in samples.mean_bytes], where="pre",
                 color="tab:green", label="KiB, mean node")  # fmt: skip
        kib.set_ylabel("KiB per node-second")
        kib.legend(loc="upper left")
    _mark_faults(axes, cluster)
    axes.set_xlim(0, cluster.now)
    axes.set_xlabel("virtual seconds")
    axes.set_title(f"traffic, {cluster.n} nodes, per {samples.step:g} s step")
    axes.legend(loc="upper right")
    header = ["time_s", "mean_messages", "max_messages", "mean_bytes", "max_bytes"]
    columns = (samples.mean_messages, samples.max_messages, samples.mean_bytes, samples.max_bytes)
    return header, [list(row) for row in zip(samples.times, *columns, strict=True)]


def _draw_spread(axes: Any, cluster: MembershipCluster, samples: Samples) -> Rows:
    rows: list[list[Any]] = []
    for publication in cluster.publications:
        times = cluster.spread_times(publication)
        got = sorted(t for t in times.values() if t is not None)
        if not times:
            continue
        fractions = [(i + 1) / len(times) for i in range(len(got))]
        label = f"node {publication.node} at {publication.at:g} s"
        rows += [[label, at, fraction] for at, fraction in zip(got, fractions, strict=True)]
        axes.step([0.0, *got], [0.0, *fractions], where="post",
                  label=f"node {publication.node} at {publication.at:g} s")  # fmt: skip
    if not cluster.publications:
        axes.text(0.5, 0.5, "no publish faults in this scenario", ha="center",
                  va="center", transform=axes.transAxes)  # fmt: skip
    else:
        axes.axhline(0.999, color="grey", linewidth=0.8, linestyle=":")
        axes.legend(loc="lower right")
    axes.set_ylim(0, 1.02)
    axes.set_xlabel("seconds since published")
    axes.set_ylabel("fraction of running nodes holding it")
    axes.set_title("record spread")
    return ["publication", "seconds_since_published", "fraction_holding"], rows


def _mark_faults(axes: Any, cluster: MembershipCluster) -> None:
    """Partitions and cuts shaded; node faults as thin vertical lines at
    their start; each kind named once in the legend."""
    for number, (start, heal) in enumerate(cluster.partitions()):
        axes.axvspan(start, min(heal, cluster.now), color="tab:red", alpha=0.08, linewidth=0,
                     label=None if number else "partition or cut")  # fmt: skip
    starts = sorted({fault.start for node in cluster.nodes for fault in node.faults})
    for number, start in enumerate(s for s in starts if math.isfinite(s)):
        axes.axvline(start, color="grey", linewidth=0.6, linestyle="--",
                     label=None if number else "crash, pause or leave")  # fmt: skip
