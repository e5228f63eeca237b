"""Which tokens of a sequence, or of one slice of it, each context-parallel (CP) rank holds.

Megatron's load-balanced layout (``get_batch_on_this_cp_rank``, ``get_pos_emb_on_this_cp_rank``):
a run of L tokens is cut into 2*CP equal pieces and CP rank r holds pieces r and 2CP-1-r, in
that order, so every rank gets one early and one late piece and the same causal attention work.
Sequence-sliced schedules apply it to each slice (slice j's L_j tokens, L_j divisible by 2*CP):
every rank then holds L_j / CP tokens of every slice and the work stays balanced slice by slice,
and Megatron-LM's own ``get_batch`` produces it when handed one slice. All-gathering the ranks'
local runs gives them in rank order; :func:`to_global_order` puts them back in sequence order.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def pieces_of(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two pieces (of 2*CP) that CP rank ``cp_rank`` holds, in its local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is out of range for {cp_size} ranks")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def piece_length(length: int, cp_size: int, what: str = "a sequence") -> int:
    """Tokens per piece when ``length`` tokens are cut into 2*CP pieces; ValueError if they
    cannot be cut evenly."""
    if length % (2 * cp_size):
        raise ValueError(
            f"{what} of {length} tokens cannot be cut into 2 x {cp_size} equal pieces for context "
            f"parallelism: its length must be a multiple of {2 * cp_size}"
        )
    return length // (2 * cp_size)


def local_positions(start: int, length: int, cp_size: int, cp_rank: int) -> list[int]:
    """Global positions of the tokens CP rank ``cp_rank`` holds of the run [start, start + length)."""
    piece = piece_length(length, cp_size)
    return [start + p * piece + i for p in pieces_of(cp_size, cp_rank) for i in range(piece)]


def take_local(x: Tensor, dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """This rank's two pieces of ``x`` along ``dim`` (the whole run), concatenated."""
    if cp_size == 1:
        return x
    dim = dim % x.dim()
    piece = piece_length(x.shape[dim], cp_size)
    parts = [x.narrow(dim, p * piece, piece) for p in pieces_of(cp_size, cp_rank)]
    return torch.cat(parts, dim=dim)


@functools.cache
def _gathered_index(cp_size: int) -> tuple[int, ...]:
    """For each global piece i, its index among the pieces of the rank-ordered gather."""
    where = {}
    for rank in range(cp_size):
        for half, piece in enumerate(pieces_of(cp_size, rank)):
            where[piece] = 2 * rank + half
    return tuple(where[i] for i in range(2 * cp_size))


def _permute_pieces(x: Tensor, dim: int, cp_size: int, order: tuple[int, ...]) -> Tensor:
    dim = dim % x.dim()
    piece = piece_length(x.shape[dim], cp_size, "a gathered run")
    pieces = x.unflatten(dim, (2 * cp_size, piece))
    index = torch.tensor(order, dtype=torch.long, device=x.device)
    return pieces.index_select(dim, index).flatten(dim, dim + 1)


def to_global_order(x: Tensor, dim: int, cp_size: int) -> Tensor:
    """``x`` holds every rank's local run along ``dim``, in rank order (an all-gather): the same
    tokens in sequence order."""
    return _permute_pieces(x, dim, cp_size, _gathered_index(cp_size))


def to_gathered_order(x: Tensor, dim: int, cp_size: int) -> Tensor:
    """Inverse of :func:`to_global_order`: a run in sequence order, as the ranks' local runs in
    rank order (what a reduce-scatter hands back to each owner)."""
    order = _gathered_index(cp_size)
    inverse = [0] * len(order)
    for piece, position in enumerate(order):
        inverse[position] = piece
    return _permute_pieces(x, dim, cp_size, tuple(inverse))
