"""The bench's table: one line per schedule, ours beside the baseline's (torch's or Megatron's).

With overlapped pairs (``--overlap-moe-expert-parallel-comm``) each schedule has a second line,
"NAME paired": ours paired, timed in the same rounds, against Megatron's combined 1F1B where the
row ran it (interleaved 1F1B's), else against the same Megatron schedule as the unpaired line;
its notes give paired/unpaired per round, and Megatron's own combined/plain."""

from __future__ import annotations

from typing import Any

SHARED = " (the ranks share the GPU, messages staged through host memory)"
PAIRS = "pairs/step (r0/r1..)"  # per global rank, as the peaks
BASELINES = {"torch": "torch.distributed.pipelining", "megatron": "megatron-core's own schedules"}


def fmt_bytes(value: int) -> str:
    if value >= 2**30:
        return f"{value / 2**30:.2f}G"
    if value >= 2**20:
        return f"{value / 2**20:.2f}M"
    return f"{value / 2**10:.0f}K"


def fmt_peaks(peaks: list[int | None]) -> str:
    return "/".join(fmt_bytes(p) if p is not None else "-" for p in peaks)


def fmt_ratio(item: dict[str, Any]) -> str:
    """Median of the per-round ratios, with their interquartile range."""
    if item.get("ratio") is None:
        return "-"
    iqr = item.get("ratio_iqr")
    return f"{item['ratio']:.2f}" + (f" [{iqr[0]:.2f}-{iqr[1]:.2f}]" if iqr else "")


def fmt_spread(spread: dict[str, float] | None) -> str:
    """min / median / max of the per-round ratios."""
    if not spread:
        return "-"
    return f"{spread['min']:.2f} / {spread['median']:.2f} / {spread['max']:.2f}"


def table_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for item in results["rows"]:
        rows.append(plain_line(results, item))
        if "ours_paired_skip" in item:  # the row ran with --overlap-moe-expert-parallel-comm
            rows.append(paired_line(results, item))
    return rows


def plain_line(results: dict[str, Any], item: dict[str, Any]) -> dict[str, str]:
    """Ours unpaired against the row's baseline."""
    against = results.get("against", "torch")
    ours, theirs = item.get("ours"), item.get(against)
    notes = list(item.get("notes", []))
    if ours is None and item.get("ours_skip"):
        notes.append(f"ours skipped: {item['ours_skip']}")
    if against == "megatron":
        label = item.get("megatron_schedule")
        if theirs is None and item.get("megatron_skip"):
            notes.append(f"Megatron skipped: {item['megatron_skip']}")
    else:
        label = item.get("torch_class")
        if theirs is None and label and item.get("torch_skip"):
            notes.append(f"torch skipped: {item['torch_skip']}")
        elif label is None:
            notes.append("no torch counterpart")
    check = item.get("check")
    if check is not None:
        notes.insert(0, f"loss/grad check {'ok' if check['match'] else 'MISMATCH'}")
    spread = item.get("ours_over_megatron") if against == "megatron" else None
    return line(results, label_of(item), ours, label, theirs, spread, item, notes)


def paired_line(results: dict[str, Any], item: dict[str, Any]) -> dict[str, str]:
    """Ours paired against Megatron's combined 1F1B where the row ran it, else the row's baseline."""
    ours = item.get("ours_paired")
    baseline = item.get("ours_paired_baseline", "megatron")
    label = item.get(f"{baseline}_schedule")
    notes = []
    if item.get("ours_paired_check") is not None:
        notes.append(f"loss/grad check {'ok' if item['ours_paired_check']['match'] else 'MISMATCH'}")
    if ours is None:
        notes.append(f"ours paired skipped: {item.get('ours_paired_skip')}")
    if item.get("paired_over_unpaired"):
        notes.append(f"paired/unpaired {fmt_spread(item['paired_over_unpaired'])}")
    pairs = (ours or {}).get("pairs") or []
    if ours is not None and not any(pairs):
        notes.append("no pair taken at the run's FLOP costs (schedule/pairing.py)")
    notes += combined_notes(item)
    spread = item.get("ours_paired_over_baseline")
    row = line(results, f"{label_of(item)} paired", ours, label, item.get(baseline), spread, item, notes)
    row[PAIRS] = "/".join(str(p) for p in pairs) if pairs else "-"
    return row


def combined_notes(item: dict[str, Any]) -> list[str]:
    """Megatron's combined 1F1B in this row: how it compares with its plain schedule, or why not."""
    if "megatron_combined_schedule" not in item:
        return ["Megatron's A2A overlap (combined 1F1B) runs interleaved only"]
    if item.get("megatron_combined") is None:
        return [f"Megatron's combined 1F1B skipped: {item.get('megatron_combined_skip')}"]
    check = item.get("megatron_combined_check") or {}
    ratio = item.get("megatron_combined_over_megatron")
    return [
        f"Megatron combined/plain {fmt_spread(ratio)}, "
        f"loss/grad check {'ok' if check.get('match') else 'MISMATCH'}"
    ]


def line(
    results: dict[str, Any],
    schedule: str,
    ours: dict[str, Any] | None,
    label: str | None,
    theirs: dict[str, Any] | None,
    spread: dict[str, float] | None,
    item: dict[str, Any],
    notes: list[str],
) -> dict[str, str]:
    """One line of the table: ``ours`` (a job's results) beside ``theirs``."""
    against = results.get("against", "torch")
    row = {
        "schedule": schedule,
        "ours s": f"{ours['median_s']:.4f}" if ours else "-",
        f"{against} schedule": label or "-",
        f"{against} s": f"{theirs['median_s']:.4f}" if theirs else "-",
    }
    if against == "megatron":
        row["ours/megatron min/median/max"] = fmt_spread(spread)
    else:
        row["ours/torch [IQR]"] = fmt_ratio(item)
    if results.get("overlap_moe_expert_parallel_comm"):
        row[PAIRS] = "-"  # a paired line's own (paired_line)
    row["ours peak act (r0/r1..)"] = fmt_peaks(ours["peak_activation_bytes"]) if ours else "-"
    row[f"{against} peak act (r0/r1..)"] = fmt_peaks(theirs["peak_activation_bytes"]) if theirs else "-"
    if results.get("count_calls"):
        calls = [side.get("calls_per_step") if side else None for side in (ours, theirs)]
        row["Python calls/step r0 (ours / base)"] = " / ".join(f"{c:,}" if c else "-" for c in calls)
    if results["device"] == "cuda":  # the allocator's peak: weights, gradients and all
        row["ours alloc peak"] = fmt_peaks(ours["peak_allocated_bytes"]) if ours else "-"
        row[f"{against} alloc peak"] = fmt_peaks(theirs["peak_allocated_bytes"]) if theirs else "-"
    row["notes"] = "; ".join(notes)
    return row


def label_of(item: dict[str, Any]) -> str:
    offload = item.get("offload", "none")
    return item["schedule"] if offload == "none" else f"{item['schedule']} offload={offload}"


def offload_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """Each row with ``--pp-offload``: ours against the same schedule without offload, and
    Megatron's with fine-grained offloading against Megatron's without, timed in the same paired
    rounds: the highest rank's peak, the share it saves, the step-time overhead (min / median /
    max of the per-round ratios) and whether the step stayed the same. On a GPU the peaks are the
    allocator's, on CPU the activation meter's (what autograd keeps)."""
    key = "peak_allocated_bytes" if results["device"] == "cuda" else "peak_activation_bytes"
    rows = []
    for item in results["rows"]:
        if item.get("offload", "none") == "none":
            continue
        row = {"schedule": label_of(item)}
        sides = [("ours", "ours")]
        if results.get("against") == "megatron":
            sides.append(("megatron", "Megatron fine-grained"))
        for side, label in sides:
            now, before = item.get(side), item.get(f"{side}_plain")
            if now is None or before is None or "offload_overhead" not in now:
                row[f"{label} peak (saved)"] = row[f"{label} overhead min/median/max"] = "-"
                continue
            peak, was = max(now[key]), max(before[key])
            same = "" if now.get("same_step_as_plain") else ", STEP DIFFERS"
            row[f"{label} peak (saved)"] = f"{fmt_bytes(peak)} ({1 - peak / was:.0%}{same})" if was else "-"
            overhead = now["offload_overhead"]
            row[f"{label} overhead min/median/max"] = " / ".join(
                f"{overhead[k] - 1:+.1%}" for k in ("min", "median", "max")
            )
        rows.append(row)
    return rows


def parallel_text(results: dict[str, Any]) -> str:
    """`` ep=2 (4 processes, dp=2)`` with expert parallelism, else nothing."""
    ep = results.get("ep", 1)
    if ep == 1:
        return ""
    return f" ep={ep} ({results['world']} processes, {ep} data-parallel pipelines)"


def experts_text(model: dict[str, Any]) -> str:
    """``, 4 experts top-2 (alltoall)`` for a mixture-of-experts model, else nothing."""
    extra = model.get("extra", {})
    if "num_moe_experts" not in extra:
        return ""
    return (
        f", {extra['num_moe_experts']} experts top-{extra.get('moe_router_topk', 2)} "
        f"({extra.get('moe_token_dispatcher_type', 'allgather')} dispatcher, "
        f"EP {extra.get('expert_model_parallel_size', 1)})"
    )


def format_table(rows: list[dict[str, str]], markdown: bool = False) -> str:
    headers = list(rows[0])
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row[h] for h in headers) + " |" for row in rows]
        return "\n".join(lines)
    widths = {h: max(len(h), *(len(row[h]) for row in rows)) for h in headers}
    lines = ["  ".join(h.ljust(widths[h]) for h in headers), "  ".join("-" * widths[h] for h in headers)]
    lines += ["  ".join(row[h].ljust(widths[h]) for h in headers) for row in rows]
    return "\n".join(lines)


def header(results: dict[str, Any]) -> str:
    model = results["model"]
    return (
        f"bench: pp={results['pp']}{parallel_text(results)} m={results['microbatches']} "
        f"model={results['model_size']} "
        f"({model['num_layers']} layers, hidden {model['hidden_size']}, seq {model['seq_length']}"
        f"{experts_text(model)}, "
        f"micro-batch {results['micro_batch_size']}), {results['device']}/{results['backend']}"
        f"{SHARED if results.get('shared_gpu') else ''}, "
        f"{results['threads_per_rank']} thread(s) per rank"
        f"{', pinned to a core each' if results.get('pinned') else ''}, torch {results['torch']}; "
        f"median of {results['iterations']} paired rounds after {results['warmup']} warm-up, "
        f"against {BASELINES[results.get('against', 'torch')]}"
    )
