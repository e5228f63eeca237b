"""The bench's table: one line per schedule, ours beside torch's counterpart."""

from __future__ import annotations

from typing import Any


def fmt_bytes(value: int) -> str:
    if value >= 2**20:
        return f"{value / 2**20:.2f}M"
    return f"{value / 2**10:.0f}K"


def fmt_peaks(peaks: list[int]) -> str:
    return "/".join(fmt_bytes(p) for p in peaks)


def fmt_ratio(item: dict[str, Any]) -> str:
    """Median of the per-iteration ratios, with their interquartile range."""
    if item.get("ratio") is None:
        return "-"
    iqr = item.get("ratio_iqr")
    return f"{item['ratio']:.2f}" + (f" [{iqr[0]:.2f}-{iqr[1]:.2f}]" if iqr else "")


def table_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for item in results["rows"]:
        ours, theirs = item.get("ours"), item.get("torch")
        notes = list(item.get("notes", []))
        if ours is None and item.get("ours_skip"):
            notes.append(f"ours skipped: {item['ours_skip']}")
        if theirs is None and item.get("torch_class") and item.get("torch_skip"):
            notes.append(f"torch skipped: {item['torch_skip']}")
        elif item.get("torch_class") is None:
            notes.append("no torch counterpart")
        check = item.get("check")
        if check is not None:
            notes.insert(0, f"loss/grad check {'ok' if check['match'] else 'MISMATCH'}")
        rows.append(
            {
                "schedule": item["schedule"],
                "ours s": f"{ours['median_s']:.4f}" if ours else "-",
                "torch schedule": item.get("torch_class") or "-",
                "torch s": f"{theirs['median_s']:.4f}" if theirs else "-",
                "ours/torch [IQR]": fmt_ratio(item),
                "ours peak act (r0/r1..)": fmt_peaks(ours["peak_activation_bytes"]) if ours else "-",
                "torch peak act (r0/r1..)": fmt_peaks(theirs["peak_activation_bytes"]) if theirs else "-",
            }
        )
        if results["device"] == "cuda":  # the allocator's peak: weights, gradients and all
            rows[-1]["ours alloc peak"] = fmt_peaks(ours["peak_allocated_bytes"]) if ours else "-"
            rows[-1]["torch alloc peak"] = fmt_peaks(theirs["peak_allocated_bytes"]) if theirs else "-"
        rows[-1]["notes"] = "; ".join(notes)
    return rows


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
        f"bench: pp={results['pp']} m={results['microbatches']} model={results['model_size']} "
        f"({model['num_layers']} layers, hidden {model['hidden_size']}, seq {model['seq_length']}, "
        f"micro-batch {results['micro_batch_size']}), {results['device']}/{results['backend']}, "
        f"{results['threads_per_rank']} thread(s) per rank, torch {results['torch']}; "
        f"median of {results['iterations']} iterations after {results['warmup']} warm-up"
    )
