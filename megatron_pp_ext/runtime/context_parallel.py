"""Context parallelism (CP) seen from the runtime: the CP group, the slices it can cut, the loss.

Under CP each rank's ``loss_func`` sums the loss of its own tokens and counts them. The loss of
a sequence is the sum over all its tokens divided by their number on ALL CP ranks, and Megatron's
DDP averages gradients over DP x CP, so each rank scales its sum by CP / (tokens on all CP ranks):
exactly the single-process loss. Megatron's own schedules divide by the local count, which is
the same only when every CP rank holds as many unmasked tokens. With ``calculate_per_token_loss``
nothing changes: ``finalize_model_grads`` divides by the count summed over DP x CP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor


def cp_size_of(config: Any) -> int:
    return int(getattr(config, "context_parallel_size", 1) or 1)


def context_parallel_group(config: Any, group: Any = None) -> Any:
    """Megatron's CP group when the chunks' config asks for CP > 1, else None. ``group``: the
    caller's (a ``pg_collection.cp``), used instead of Megatron's parallel state."""
    size = cp_size_of(config)
    if size == 1:
        return None
    if group is not None:
        if dist.get_world_size(group) != size:
            raise ValueError(
                f"context_parallel_size={size} but the given context-parallel group has "
                f"{dist.get_world_size(group)} ranks"
            )
        return group
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            f"context_parallel_size={size} needs Megatron's parallel state with that CP size "
            "(init_parallel_state(pp, tp, cp))"
        )
    group = parallel_state.get_context_parallel_group()
    if dist.get_world_size(group) != size:
        raise ValueError(
            f"context_parallel_size={size} but Megatron's context-parallel group has "
            f"{dist.get_world_size(group)} ranks"
        )
    return group


def tokens_on_all_cp_ranks(num_tokens: Tensor | int, group: Any, device: torch.device) -> Tensor:
    """``num_tokens`` (this rank's count) summed over the CP group. Collective: every CP rank of
    the stage calls it at the same op."""
    total = torch.as_tensor(num_tokens, device=device).detach().clone()
    dist.all_reduce(total, group=group)
    return total


def check_cp_slices(lengths: Sequence[int], config: Any) -> None:
    """Every slice must cut into 2*CP equal pieces (and, under sequence parallelism, a rank's
    share of it into TP parts); ValueError naming the slice and the flags otherwise."""
    cp = cp_size_of(config)
    if cp == 1:
        return
    tp = (
        int(getattr(config, "tensor_model_parallel_size", 1))
        if getattr(config, "sequence_parallel", False)
        else 1
    )
    for index, length in enumerate(lengths):
        if length % (2 * cp) or (length // cp) % tp:
            need = 2 * cp if tp == 1 else f"2 x {cp} and of {cp} x {tp} (sequence parallelism)"
            raise ValueError(
                f"slice {index} of {list(lengths)} has {length} tokens, not a multiple of {need}: "
                f"context parallelism cuts every slice into 2 x {cp} pieces; change --seq-length "
                "or --pp-seq-slices"
            )
