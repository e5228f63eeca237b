"""Pictures of a simulated schedule: a timeline image and a Chrome/Perfetto trace.

The image has one row per rank (F/B/W/BW boxes coloured by kind, lighter for later model chunks,
labelled ``microbatch.slice``; activation copies to and from host memory as a thin strip under
them; with vocabulary parallelism the S and T passes in their own colours and each collective as a
thin line at the top of the row, from the rank's issue to the completion) with that rank's
activation-memory curve, in units of M, right under it. The trace
(``traceEvents`` with complete "X" events, one process per rank with a compute lane and a lane
per copy direction, plus a memory counter track) opens in ui.perfetto.dev or chrome://tracing for
zooming into long schedules.

matplotlib is imported inside :func:`plot_timeline` so the schedule core stays import-light.
"""

from __future__ import annotations

import json
from typing import Any

from .ir import OpKind
from .replay import Event, SimResult

KIND_COLOURS = {
    OpKind.F: "#3f7fc8",
    OpKind.B: "#3ea860",
    OpKind.W: "#9a6fc0",
    OpKind.BW: "#d9534f",
    OpKind.OFFLOAD: "#e08a2c",
    OpKind.RELOAD: "#2aa3a3",
    OpKind.S: "#f2c12e",
    OpKind.T: "#8a6a12",
}
COLLECTIVE_COLOURS = {
    OpKind.BCAST_X: "#f2c12e",
    OpKind.REDUCE_S: "#c9302c",
    OpKind.REDUCE_T: "#6f42c1",
    OpKind.BCAST_IDS: "#bbbbbb",
    OpKind.REDUCE_EMB: "#c77fa8",
    OpKind.BCAST_DEMB: "#7a3d62",
}
LEGEND_NAMES = {
    OpKind.S: "S (vocab: logits, max, sum)",
    OpKind.T: "T (vocab: softmax grad, dW)",
}
COPY_STRIP = 0.25  # share of a rank's row that its copies take, at the bottom
COLLECTIVE_STRIP = 0.12  # share of a rank's row that its collectives take, at the top
LABEL_FONT_PT = 6.5
LEFT, RIGHT = 0.065, 0.985  # figure fractions around the axes
MAX_LABELS = 5000  # beyond this many readable boxes, text costs more time than it helps


def op_label(event: Event, num_slices: int) -> str:
    """``microbatch.slice``, or just ``microbatch`` when sequences are not sliced."""
    op = event.op
    return f"{op.microbatch}.{op.slice}" if num_slices > 1 else str(op.microbatch)


def trace_name(event: Event, num_slices: int) -> str:
    """``F 3.1 s2``: kind, microbatch[.slice], virtual stage."""
    return f"{event.op.kind.value} {op_label(event, num_slices)} s{event.op.stage}"


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Blend toward white for later chunks so chunk 0 is the darkest."""
    rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.0 if chunks <= 1 else 0.5 * chunk / (chunks - 1)
    return (rgb[0] + (1 - rgb[0]) * mix, rgb[1] + (1 - rgb[1]) * mix, rgb[2] + (1 - rgb[2]) * mix)


def _text_colour(fill: tuple[float, float, float]) -> str:
    """White on dark boxes, near-black on the light shades of later chunks."""
    luminance = 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2]
    return "white" if luminance < 0.6 else "#222222"


def _time_of(point: tuple[float, float]) -> float:
    return point[0]


def _title(result: SimResult) -> str:
    s = result.schedule
    peaks = result.peak_memory_m
    worst = max(range(len(peaks)), key=peaks.__getitem__) if peaks else 0
    partition = s.meta.get("partition")
    cut = f" ({partition})" if s.slices > 1 and partition else ""
    vocab = f" + {s.vocab_parallel}" if s.vocab_parallel != "none" else ""
    return (
        f"{s.name}{vocab}: p={s.pp} m={s.microbatches} v={s.vpp} k={s.slices}{cut}   "
        f"bubble {result.bubble_rate:.1%}   peak {max(peaks, default=0.0):.3f} M (rank {worst}), "
        f"rank 0 {peaks[0] if peaks else 0.0:.3f} M"
    )


def _time_scale(makespan: float, time_unit: str) -> tuple[float, str]:
    """Multiplier and axis label; seconds become milliseconds when the whole run is under 1 s."""
    if time_unit == "s" and 0 < makespan < 1:
        return 1e3, "time (ms)"
    return 1.0, f"time ({time_unit})" if time_unit else "time"


def plot_timeline(
    result: SimResult,
    path: str,
    *,
    time_unit: str = "",
    width_in: float = 16.0,
    dpi: int = 130,
) -> None:
    """Write the timeline to ``path``; PNG or SVG (or anything matplotlib knows) by suffix.

    ``time_unit`` labels the x axis ("s" for the FLOP cost model, whose times are seconds; leave
    empty for the unit-free uniform model).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule = result.schedule
    pp = schedule.pp
    scale, xlabel = _time_scale(result.makespan, time_unit)
    makespan = result.makespan * scale or 1.0

    row_in, mem_in = 0.5, 0.4
    height_in = 1.1 + pp * (row_in + mem_in)
    fig = plt.figure(figsize=(width_in, height_in), dpi=dpi)
    grid = fig.add_gridspec(
        2 * pp,
        1,
        height_ratios=[row_in, mem_in] * pp,
        hspace=0.08,
        left=LEFT,
        right=RIGHT,
        top=1 - 0.75 / height_in,
        bottom=0.45 / height_in,
    )
    first_axis = fig.add_subplot(grid[0])
    op_axes = [first_axis] + [fig.add_subplot(grid[2 * r], sharex=first_axis) for r in range(1, pp)]
    mem_axes = [fig.add_subplot(grid[2 * r + 1], sharex=first_axis) for r in range(pp)]

    _draw_ops(op_axes, result, scale, makespan, width_in)

    peak_m = max(result.peak_memory_m, default=0.0) or 1.0
    unit = result.microbatch_activation or 1.0
    for rank, axis in enumerate(mem_axes):
        curve = result.memory_curves[rank] if rank < len(result.memory_curves) else [(0.0, 0.0)]
        curve = sorted(curve, key=_time_of)  # stable: same-time changes keep their order
        times = [t * scale for t, _ in curve] + [makespan]
        values = [v / unit for _, v in curve]
        values.append(values[-1])
        axis.fill_between(times, values, step="post", color="#f0ad4e", alpha=0.45, linewidth=0)
        axis.step(times, values, where="post", color="#b8741a", linewidth=0.8)
        axis.set_ylim(0, peak_m * 1.15)
        axis.set_yticks([0, round(peak_m, 2)])
        axis.tick_params(axis="y", labelsize=6.5, length=2, pad=1)
        axis.set_ylabel(
            f"peak\n{result.peak_memory_m[rank]:.3f} M",
            rotation=0,
            ha="right",
            va="center",
            fontsize=7,
            color="#7a4d10",
        )
        if rank < pp - 1:
            axis.tick_params(labelbottom=False)
        for side in ("top", "right"):
            axis.spines[side].set_visible(False)
    mem_axes[-1].set_xlabel(xlabel, fontsize=9)
    first_axis.set_xlim(0, makespan)

    extra = [Patch(color="#f0ad4e", alpha=0.6, label="activation memory (M)")]
    if result.collectives:
        extra.insert(0, Patch(color=COLLECTIVE_COLOURS[OpKind.REDUCE_S], label="collectives (top strip)"))
    _legend(fig, [result], height_in, extra)
    fig.suptitle(_title(result), x=LEFT, y=1 - 0.12 / height_in, ha="left", va="top", fontsize=10)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _draw_ops(op_axes: list[Any], result: SimResult, scale: float, makespan: float, width_in: float) -> None:
    """One row of boxes per rank of ``result`` on ``op_axes``, each labelled with its rank."""
    from matplotlib.collections import PolyCollection

    schedule = result.schedule
    pp, chunks, num_slices = schedule.pp, schedule.vpp, schedule.slices
    # Label only boxes wide enough for their text: widths in points, from axes width in inches.
    axis_width_pt = width_in * (RIGHT - LEFT) * 72
    char_pt = LABEL_FONT_PT * 0.62
    labels_left = MAX_LABELS

    by_rank: list[list[Event]] = [[] for _ in range(pp)]
    for event in result.events:
        by_rank[event.rank].append(event)
    bottom = COPY_STRIP + 0.05 if result.copies else 0.0
    top = 1.0 - COLLECTIVE_STRIP - 0.03 if result.collectives else 1.0
    transfer_start: dict[tuple, float] = {}
    for event in result.collectives:
        key = (event.op.kind, event.op.unit)
        transfer_start[key] = max(transfer_start.get(key, 0.0), event.start)

    for rank, axis in enumerate(op_axes):
        polygons: list[list[tuple[float, float]]] = []
        colours: list[tuple[float, float, float]] = []
        texts: list[tuple[float, str, str]] = []
        for event in [e for e in result.copies if e.rank == rank]:
            start, end = event.start * scale, event.end * scale
            polygons.append([(start, 0.0), (end, 0.0), (end, COPY_STRIP), (start, COPY_STRIP)])
            colours.append(_shade(KIND_COLOURS[event.op.kind], 0, 1))
        for event in [e for e in result.collectives if e.rank == rank]:
            # from the last rank's issue (the transfer) to the completion
            start, end = transfer_start[(event.op.kind, event.op.unit)] * scale, event.end * scale
            polygons.append(
                [(start, 1.0 - COLLECTIVE_STRIP), (end, 1.0 - COLLECTIVE_STRIP), (end, 1.0), (start, 1.0)]
            )
            colours.append(_shade(COLLECTIVE_COLOURS.get(event.op.kind, "#999999"), 0, 1))
        for event in by_rank[rank]:
            start, end = event.start * scale, event.end * scale
            polygons.append([(start, bottom), (end, bottom), (end, top), (start, top)])
            chunk = 0 if event.op.is_vocab else schedule.placement.chunk_index(event.op.stage)
            colours.append(_shade(KIND_COLOURS[event.op.kind], chunk, chunks))
            label = op_label(event, num_slices)
            box_pt = (end - start) / makespan * axis_width_pt
            if labels_left > 0 and box_pt >= char_pt * len(label) + 2:
                texts.append(((start + end) / 2, label, _text_colour(colours[-1])))
                labels_left -= 1
        axis.add_collection(PolyCollection(polygons, facecolors=colours, edgecolors="white", linewidths=0.4))
        for x, label, colour in texts:
            axis.text(
                x, (top + bottom) / 2, label, ha="center", va="center", fontsize=LABEL_FONT_PT, color=colour
            )
        axis.set_ylim(0, 1)
        axis.set_yticks([])
        axis.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center", fontsize=9)
        axis.tick_params(labelbottom=False, bottom=False)
        for side in ("top", "right", "left"):
            axis.spines[side].set_visible(False)


def _legend(fig: Any, results: list[SimResult], height_in: float, extra: list[Any] = ()) -> None:
    """The kinds drawn, the chunk shading, then ``extra`` handles, in one row at the top right."""
    from matplotlib.patches import Patch

    present = [e.op.kind for result in results for e in result.events + result.copies]
    kinds = [kind for kind in KIND_COLOURS if kind in present]
    handles = [Patch(color=KIND_COLOURS[kind], label=LEGEND_NAMES.get(kind, kind.value)) for kind in kinds]
    chunks = max(result.schedule.vpp for result in results)
    if chunks > 1:
        shades = [_shade(KIND_COLOURS[OpKind.F], c, chunks) for c in (0, chunks - 1)]
        handles.append(
            Patch(facecolor=shades[1], edgecolor=shades[0], label=f"lighter: later chunk (v={chunks})")
        )
    handles += list(extra)
    fig.legend(
        handles=handles,
        loc="upper right",
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(RIGHT, 1 - 0.32 / height_in),
    )


def plot_comparison(
    results: list[tuple[str, SimResult]], path: str, *, width_in: float = 16.0, dpi: int = 130
) -> None:
    """Several timelines of one schedule on one time axis (seconds), one block of rank rows each,
    titled with its label and per-rank bubble: a real run above the simulator's prediction
    (``runtime/timeline.py``). No memory rows: a run measures its peak only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizon = max(result.makespan for _, result in results) or 1.0
    scale, xlabel = _time_scale(horizon, "s")
    row_in, gap = 0.45, 1
    rows = sum(result.schedule.pp + gap for _, result in results) - gap
    height_in = 1.2 + rows * row_in + 0.3 * len(results)
    fig = plt.figure(figsize=(width_in, height_in), dpi=dpi)
    ratios = []
    for index, (_, result) in enumerate(results):
        ratios += [1.0] * result.schedule.pp + ([0.9] if index < len(results) - 1 else [])
    grid = fig.add_gridspec(
        len(ratios), 1, height_ratios=ratios, hspace=0.1, left=LEFT + 0.04, right=RIGHT,
        top=1 - 0.75 / height_in, bottom=0.5 / height_in,
    )  # fmt: skip
    first = None
    row = 0
    for index, (label, result) in enumerate(results):
        axes = []
        for _ in range(result.schedule.pp):
            axis = (
                fig.add_subplot(grid[row], sharex=first) if first is not None else fig.add_subplot(grid[row])
            )
            first = first or axis
            axes.append(axis)
            row += 1
        _draw_ops(axes, result, scale, horizon * scale, width_in)
        bubbles = " ".join(f"{rate:.0%}" for rate in result.bubble_rate_per_rank)
        axes[0].set_title(
            f"{label}: {result.makespan * scale:.3g} {xlabel[6:-1]}, bubble per rank {bubbles}",
            loc="left", fontsize=9,
        )  # fmt: skip
        if index == len(results) - 1:
            axes[-1].tick_params(labelbottom=True, bottom=True)
            axes[-1].set_xlabel(xlabel, fontsize=9)
        row += 1 if index < len(results) - 1 else 0
    first.set_xlim(0, horizon * scale)
    _legend(fig, [result for _, result in results], height_in)
    s = results[0][1].schedule
    fig.suptitle(
        f"{s.name}: p={s.pp} m={s.microbatches} v={s.vpp} k={s.slices}",
        x=LEFT, y=1 - 0.12 / height_in, ha="left", va="top", fontsize=10,
    )  # fmt: skip
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def trace_events(result: SimResult, microseconds_per_unit: float = 1e6) -> dict[str, Any]:
    """Chrome trace dict: one process per rank, an "X" event per op, a memory counter (in M).

    ``microseconds_per_unit`` converts simulated time to the trace's microseconds: 1e6 when the
    cost model counts seconds (the FLOP model); unit-free models then read as seconds.
    """
    schedule = result.schedule
    unit = result.microbatch_activation or 1.0
    events: list[dict[str, Any]] = []
    for rank in range(schedule.pp):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}})
    copy_lanes = {OpKind.OFFLOAD: 1, OpKind.RELOAD: 2}
    copy_lanes.update({kind: 3 for kind in COLLECTIVE_COLOURS})
    lanes = [(result.copies, (("device to host", 1), ("host to device", 2)))]
    lanes.append((result.collectives, (("vocabulary collectives", 3),)))
    for present, names in lanes:
        if not present:
            continue
        for rank in range(schedule.pp):
            for name, tid in names:
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
                )
    for event in result.events + result.copies + result.collectives:
        op = event.op
        events.append(
            {
                "name": trace_name(event, schedule.slices),
                "cat": op.kind.value,
                "ph": "X",
                "pid": event.rank,
                "tid": copy_lanes.get(op.kind, 0),
                "ts": event.start * microseconds_per_unit,
                "dur": (event.end - event.start) * microseconds_per_unit,
                "args": {
                    "stage": op.stage,
                    "chunk": schedule.placement.chunk_index(op.stage),
                    "microbatch": op.microbatch,
                    "slice": op.slice,
                },
            }
        )
    for rank, curve in enumerate(result.memory_curves):
        for time, value in sorted(curve, key=_time_of):
            events.append(
                {
                    "name": "activation",
                    "ph": "C",
                    "pid": rank,
                    "ts": time * microseconds_per_unit,
                    "args": {"M": value / unit},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": result.to_dict()}


def write_trace(result: SimResult, path: str, microseconds_per_unit: float = 1e6) -> None:
    """Write :func:`trace_events` as JSON to ``path`` (open it in ui.perfetto.dev)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(trace_events(result, microseconds_per_unit), handle)


def write_trace_of(results: list[tuple[str, SimResult]], path: str) -> None:
    """Several timelines (seconds) in one trace: each result's ranks as processes of their own,
    named ``LABEL rank r`` (a real run beside its prediction, ``runtime/timeline.py``)."""
    events: list[dict[str, Any]] = []
    other: dict[str, Any] = {}
    offset = 0
    for label, result in results:
        for event in trace_events(result)["traceEvents"]:
            event = dict(event)
            event["pid"] = event["pid"] + offset
            if event.get("name") == "process_name":
                event["args"] = {"name": f"{label} {event['args']['name']}"}
            if event.get("name") == "process_sort_index":
                event["args"] = {"sort_index": event["pid"]}
            events.append(event)
        other[label] = result.to_dict()
        offset += result.schedule.pp
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, handle)
