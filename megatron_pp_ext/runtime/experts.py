"""The collective groups a mixture-of-experts chunk talks over inside its forward and backward.

megatron-core's MoE layers gather or exchange tokens over the expert-parallel groups (the
allgather dispatcher over expert TP x EP, the all-to-all one over EP, expert TP in the experts'
linears). Under NCCL each group's communicator is created at its first collective; the runtime's
warm-up (``creation.py``) creates them before the step instead, in the one global order, with
the pipeline's own. A model without experts, or with every expert group of one rank, has none.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

_GROUPS = (
    ("expert-tensor-and-expert-parallel", parallel_state.get_expert_tensor_and_model_parallel_group),
    ("expert-parallel", parallel_state.get_expert_model_parallel_group),
    ("expert-tensor-parallel", parallel_state.get_expert_tensor_parallel_group),
)


def expert_groups(config: Any) -> list[tuple[str, Any]]:
    """(name, group) of each expert group of more than one rank, one per distinct member set."""
    if getattr(config, "num_moe_experts", None) is None or not parallel_state.model_parallel_is_initialized():
        return []
    found: dict[tuple[int, ...], tuple[str, Any]] = {}
    for name, get_group in _GROUPS:
        group = get_group(check_initialized=False)
        if group is None or dist.get_world_size(group) == 1:
            continue
        found.setdefault(tuple(sorted(dist.get_process_group_ranks(group))), (name, group))
    return list(found.values())
