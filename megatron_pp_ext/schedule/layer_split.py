"""How megatron-core splits the decoder layers over virtual pipeline stages, from Megatron's flags.

Megatron has four ways to say it, and refuses what it cannot build:

* an even split (``--num-layers`` over p ranks and v chunks per rank; they must divide);
* ``--decoder-first/last-pipeline-num-layers``: those counts on the first and last pipeline
  rank, the rest evenly over the others; with v chunks per rank, each rank's count over its chunks;
* ``--account-for-embedding/loss-in-pipeline-split``: the embedding (loss) counted as one layer of
  the even split, so the first (last) virtual stage builds one decoder layer fewer;
* ``--pipeline-model-parallel-layout``: every virtual stage spelled out, e.g. ``"Ett|(tt|)*2,ttL"``
  (E the embedding, t a decoder layer, L the loss; ``|`` ends a stage, ``(..)*n`` and ``x*n``
  repeat, commas are cosmetic); its stage count over p gives v.

Virtual stage s is model chunk s // p of pipeline rank s % p, in the model's order (the order of
Megatron's layout string; every placement of ours keeps it, see ``megatron/pretrain.py``).
:func:`megatron_stage_layers` gives the layers of each, checked as megatron-core's
``TransformerConfig`` checks them, so a split it would refuse is refused here first, naming the
flag. Pure Python: the planner and the hook's run costs use it without torch.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from dataclasses import dataclass

from .ir import Placement

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
LAYOUT_LETTERS = {"E": "embedding", "L": "loss", "t": "decoder layer", "m": "multi-token prediction layer"}


class SplitError(ValueError):
    """A split megatron-core would refuse (or we do not model); ``flag`` is the flag to change."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class LayerSplitFlags:
    """Megatron's layer-split flags as a run gives them (None / False where it does not)."""

    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers
    embedding_in_split: bool = False  # --account-for-embedding-in-pipeline-split
    loss_in_split: bool = False  # --account-for-loss-in-pipeline-split
    layout: str | None = None  # --pipeline-model-parallel-layout

    @property
    def even(self) -> bool:
        """True when no flag moves a layer: megatron-core's plain even split."""
        return self == LayerSplitFlags()

    @classmethod
    def from_args(cls, args: object) -> LayerSplitFlags:
        """The flags from a parsed Megatron-LM (or planner) namespace; absent attributes count as unset."""
        return cls(
            first=getattr(args, "decoder_first_pipeline_num_layers", None),
            last=getattr(args, "decoder_last_pipeline_num_layers", None),
            embedding_in_split=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
            loss_in_split=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
            layout=getattr(args, "pipeline_model_parallel_layout", None) or None,
        )


def parse_layout(text: str) -> list[str]:
    """The stages of a ``--pipeline-model-parallel-layout`` string, one string of layer letters
    each, repeats unrolled: ``"E|(tt|)*2,L"`` -> ``["E", "tt", "tt", "L"]``."""
    unrolled = text.replace(",", "").replace(" ", "")
    unrolled = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), unrolled)
    unrolled = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), unrolled)
    stages = unrolled.split("|")
    for stage in stages:
        unknown = sorted(set(stage) - set(LAYOUT_LETTERS))
        if unknown:
            raise SplitError(
                LAYOUT_FLAG,
                f"{LAYOUT_FLAG} {text!r}: unknown layer letter {unknown[0]!r} (after unrolling: {stage!r}); "
                f"the letters are {', '.join(f'{k} ({v})' for k, v in LAYOUT_LETTERS.items())}",
            )
    return stages


def layout_chunks(text: str, pp: int) -> int:
    """Model chunks per rank a layout string gives (its stage count over ``pp``)."""
    stages = len(parse_layout(text))
    if stages % pp:
        raise SplitError(
            LAYOUT_FLAG,
            f"{LAYOUT_FLAG} has {stages} stages, not a multiple of --pipeline-model-parallel-size {pp}",
        )
    return stages // pp


def megatron_stage_layers(
    layers: int, pp: int, vpp: int = 1, flags: LayerSplitFlags | None = None
) -> list[int]:
    """Decoder layers of each virtual stage (``pp * vpp`` of them, in the model's order) as
    megatron-core builds them under ``flags``. Raises :class:`SplitError` naming the flag where
    megatron-core refuses the split (or where it holds something we do not model: MTP layers)."""
    flags = flags or LayerSplitFlags()
    if pp < 1 or vpp < 1:
        raise SplitError("--pipeline-model-parallel-size", f"pp {pp} and chunks {vpp} must be at least 1")
    if flags.layout is not None:
        return _layout_layers(flags, layers, pp, vpp)
    if flags.first is not None or flags.last is not None:
        return _end_rank_layers(flags, layers, pp, vpp)
    counted = layers + flags.embedding_in_split + flags.loss_in_split
    flag = (EMBEDDING_FLAG if flags.embedding_in_split else LOSS_FLAG) if counted > layers else "--num-layers"
    what = f"{layers} layers" + (f" (+{counted - layers} counted by {flag})" if counted > layers else "")
    if counted % pp:
        raise SplitError(flag, f"{what} do not divide over --pipeline-model-parallel-size {pp}")
    per_rank = counted // pp
    if per_rank % vpp:
        raise SplitError(
            flag if counted > layers else "--num-virtual-stages-per-pipeline-rank",
            f"{what} give {per_rank} per pipeline rank, which its {vpp} model chunks cannot share evenly",
        )
    split = [per_rank // vpp] * (pp * vpp)
    split[0] -= flags.embedding_in_split
    split[-1] -= flags.loss_in_split
    if min(split) < 0:
        raise SplitError(flag, f"{what}: the end virtual stage has no decoder layer to give up")
    return split


def megatron_args_split(args: object, pp: int, chunks: int) -> tuple[int, ...] | None:
    """The layers of each virtual stage under the split flags of a parsed Megatron-LM namespace
    (``args.num_layers`` over ``pp`` ranks of ``chunks``); None when it gives none (megatron-core's
    even split) or no layer count. Raises :class:`SplitError` where megatron-core refuses."""
    flags = LayerSplitFlags.from_args(args)
    layers = getattr(args, "num_layers", None)
    if flags.even or not layers:
        return None
    return tuple(megatron_stage_layers(layers, pp, chunks, flags))


def check_layout_placement(layout: str | None, schedule: str, placement: Placement) -> None:
    """A layout under a schedule whose last stage is not on the last rank (a V): megatron-core
    places a layout's stages round-robin by the real pipeline rank, so it would build the wrong
    layers there. Raises :class:`SplitError` naming ``--pipeline-model-parallel-layout``."""
    if layout is None:
        return
    last = placement.rank_of(placement.num_stages - 1)
    if last != placement.pp - 1:
        raise SplitError(
            LAYOUT_FLAG,
            f"{schedule} places the last stage on rank {last}; a custom layout assumes Megatron's "
            "round-robin placement: use --decoder-first/last-pipeline-num-layers instead",
        )


def _end_rank_layers(flags: LayerSplitFlags, layers: int, pp: int, vpp: int) -> list[int]:
    """``--decoder-first/last-pipeline-num-layers``: megatron-core's TransformerConfig checks,
    then each rank's count over its chunks."""
    if flags.embedding_in_split or flags.loss_in_split:
        raise SplitError(
            EMBEDDING_FLAG if flags.embedding_in_split else LOSS_FLAG,
            f"{EMBEDDING_FLAG} and {LOSS_FLAG} cannot be combined with {FIRST_FLAG} / {LAST_FLAG} "
            "(megatron-core refuses it): drop one of them",
        )
    if pp < 2:
        flag = FIRST_FLAG if flags.first is not None else LAST_FLAG
        raise SplitError(flag, f"{flag} needs --pipeline-model-parallel-size of at least 2")
    rest, middle = layers, pp
    for flag, count in ((FIRST_FLAG, flags.first), (LAST_FLAG, flags.last)):
        if count is None:
            continue
        if count <= 0:
            raise SplitError(flag, f"{flag} must be at least 1, got {count}")
        if count % vpp:
            raise SplitError(flag, f"{flag} {count} does not divide over the {vpp} model chunks of a rank")
        rest, middle = rest - count, middle - 1
    flag = FIRST_FLAG if flags.first is not None else LAST_FLAG
    ends = " and ".join(str(c) for c in (flags.first, flags.last) if c is not None)
    if rest < 0 or bool(rest) != bool(middle) or (middle and rest % middle):
        raise SplitError(
            flag,
            f"{layers} layers less {ends} on the end stage(s) leave {rest}, which the {middle} other "
            "pipeline stage(s) cannot share evenly (megatron-core refuses it)",
        )
    per_middle = rest // middle if middle else 0
    if per_middle % vpp:
        raise SplitError(
            flag,
            f"the {per_middle} layers of each middle pipeline rank do not divide over its {vpp} model chunks",
        )
    per_rank = [per_middle] * pp
    if flags.first is not None:
        per_rank[0] = flags.first
    if flags.last is not None:
        per_rank[-1] = flags.last
    return [per_rank[stage % pp] // vpp for stage in range(pp * vpp)]


def _layout_layers(flags: LayerSplitFlags, layers: int, pp: int, vpp: int) -> list[int]:
    """``--pipeline-model-parallel-layout``: megatron-core's checks, plus ours: the embedding on
    the first virtual stage and the loss on the last (where our schedules put the model's ends)."""
    text = flags.layout or ""
    others = [
        name
        for name, given in (
            (FIRST_FLAG, flags.first is not None),
            (LAST_FLAG, flags.last is not None),
            (EMBEDDING_FLAG, flags.embedding_in_split),
            (LOSS_FLAG, flags.loss_in_split),
        )
        if given
    ]
    if others:
        raise SplitError(
            LAYOUT_FLAG, f"{LAYOUT_FLAG} cannot be combined with {others[0]} (megatron-core refuses it)"
        )
    stages = parse_layout(text)
    chunks = layout_chunks(text, pp)
    if chunks != vpp:
        raise SplitError(
            LAYOUT_FLAG,
            f"{LAYOUT_FLAG} has {len(stages)} stages, {chunks} model chunks per rank over {pp} pipeline "
            f"ranks, but the run has {vpp} "
            "(leave out --num-virtual-stages-per-pipeline-rank: the layout sets it)",
        )
    if "m" in text:
        raise SplitError(LAYOUT_FLAG, f"{LAYOUT_FLAG}: multi-token prediction layers (m) are not modelled")
    joined = "".join(stages)
    if joined.count("E") != 1 or "E" not in stages[0]:
        raise SplitError(
            LAYOUT_FLAG, f"{LAYOUT_FLAG} {text!r}: the embedding E must appear once, in the first stage"
        )
    if joined.count("L") != 1 or "L" not in stages[-1]:
        raise SplitError(
            LAYOUT_FLAG, f"{LAYOUT_FLAG} {text!r}: the loss L must appear once, in the last stage"
        )
    if not joined.startswith("E") or not joined.endswith("L"):
        raise SplitError(LAYOUT_FLAG, f"{LAYOUT_FLAG} {text!r}: E must be the first layer and L the last")
    split = [stage.count("t") for stage in stages]
    if sum(split) != layers:
        raise SplitError(
            LAYOUT_FLAG,
            f"{LAYOUT_FLAG} {text!r} has {sum(split)} decoder layers (t), but --num-layers is {layers}",
        )
    return split


def _rank_load(split: list[int], pp: int, ends: tuple[float, float]) -> tuple[float, float]:
    """(the busiest rank's work, the sum of squares of every rank's) in layers: each rank's
    layers, plus ``ends`` on the first and the last rank (the embedding's and the output layer's
    work). The second orders splits of one busiest rank by how evenly the others share."""
    per_rank = [float(sum(split[rank::pp])) for rank in range(pp)]
    per_rank[0] += ends[0]
    per_rank[-1] += ends[1]
    return max(per_rank), sum(load * load for load in per_rank)


@functools.lru_cache(maxsize=4096)
def uneven_splits(
    layers: int, pp: int, vpp: int = 1, min_layers: int = 1, ends: tuple[float, float] = (1.0, 1.0)
) -> tuple[LayerSplitFlags, ...]:
    """Megatron's flags that split ``layers`` unevenly over ``pp`` ranks of ``vpp`` chunks: the
    best of each family (the embedding and loss counted as layers; chosen first/last-rank counts),
    scored by the busiest rank's work with ``ends`` added on the first and the last rank (in
    layers; the default, one each, is what Megatron's ``--account-for-*`` flags assume), every
    virtual stage with at least ``min_layers``; the least loaded first. Where an even split runs
    (``layers`` a multiple of ``pp * vpp``), only those that beat it (a heavy output layer: the
    last rank takes fewer layers). Empty when none does."""
    if pp < 2:
        return ()
    stages = pp * vpp
    bar = _rank_load([layers // stages] * stages, pp, ends)[0] if layers % stages == 0 else math.inf
    families: list[list[LayerSplitFlags]] = [
        [
            LayerSplitFlags(embedding_in_split=embedding, loss_in_split=loss)
            for embedding, loss in ((True, True), (False, True), (True, False))
        ],
    ]
    counts = [None] + [x for x in range(vpp, layers // pp + 2 * vpp + 1, vpp)]
    families.append(
        [
            LayerSplitFlags(first=first, last=last)
            for first in counts
            for last in counts
            if (first, last) != (None, None)
        ]
    )
    found: list[tuple[tuple[float, float], int, LayerSplitFlags, list[int]]] = []
    for family in families:
        best: tuple[tuple[float, float], int, LayerSplitFlags, list[int]] | None = None
        for order, flags in enumerate(family):
            try:
                split = megatron_stage_layers(layers, pp, vpp, flags)
            except SplitError:
                continue
            if min(split) < min_layers:
                continue
            if best is None or (_rank_load(split, pp, ends), order) < best[:2]:
                best = (_rank_load(split, pp, ends), order, flags, split)
        if best is not None and best[0][0] < bar and all(best[3] != other[3] for other in found):
            found.append(best)  # one per distinct split
    return tuple(flags for _, _, flags, _ in sorted(found, key=lambda item: item[0]))


def split_flags(flags: LayerSplitFlags) -> list[str]:
    """``flags`` as Megatron-LM command-line arguments."""
    args: list[str] = []
    if flags.first is not None:
        args += [FIRST_FLAG, str(flags.first)]
    if flags.last is not None:
        args += [LAST_FLAG, str(flags.last)]
    args += [EMBEDDING_FLAG] if flags.embedding_in_split else []
    args += [LOSS_FLAG] if flags.loss_in_split else []
    if flags.layout is not None:
        args += [LAYOUT_FLAG, flags.layout]
    return args


def add_layer_split_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's layer-split flags, with its names and the attributes it reads (``train`` and
    ``simulate`` take them: a pretrain_gpt.py command line that moves layers runs there unchanged)."""
    split = parser.add_argument_group("the layers of each pipeline stage (Megatron's flags)")
    split.add_argument(
        FIRST_FLAG,
        dest="decoder_first_pipeline_num_layers",
        type=int,
        help="layers on the first pipeline rank",
    )
    split.add_argument(
        LAST_FLAG, dest="decoder_last_pipeline_num_layers", type=int, help="layers on the last pipeline rank"
    )
    split.add_argument(
        EMBEDDING_FLAG, action="store_true", help="count the embedding as a layer of the first stage"
    )
    split.add_argument(LOSS_FLAG, action="store_true", help="count the loss as a layer of the last stage")
    split.add_argument(
        LAYOUT_FLAG,
        dest="pipeline_model_parallel_layout",
        help='every virtual stage spelled out, e.g. "Ett|(tt|)*2,ttL" (E embedding, t layer, L loss); '
        "its stage count sets the model chunks per rank",
    )
