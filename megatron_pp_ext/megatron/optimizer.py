"""The optimizer step after ``finalize_model_grads``: Megatron's optimizer on GPU, a torch one on CPU.

Everything up to the optimizer step is the same on both paths: DDP grad buffers zeroed, the
schedule's forward and backward, ``finalize_model_grads`` (data-parallel reduction, SP norm
all-reduce, per-token scaling). Then:

- with CUDA, megatron-core's ``get_megatron_optimizer`` (Adam, distributed optimizer when the
  DDP config asks for it, gradient clipping by the global norm), as Megatron-LM builds it;
- without CUDA it cannot be built (``FP32Optimizer.__init__`` allocates with ``device='cuda'``),
  so :class:`MainGradOptimizer` steps ``torch.optim.AdamW`` on ``main_grad``, with Megatron's
  clipping rule (global L2 norm over the model-parallel group, tensor-parallel duplicates counted
  once). Under the distributed optimizer's layout DDP leaves each data-parallel rank only its
  shard of the reduced gradients; this path all-gathers the shards first, so every rank takes the
  same full step (the memory saving of sharded optimizer state is a GPU-path property).

A step whose gradients hold a NaN or an inf (the global norm is not finite) is skipped, as
Megatron skips one its loss scaler finds overflowed: no update, and the step is reported
(:class:`StepInfo`). :class:`MainGradOptimizer` can post-validate (``post_validation.py``: step
before the global check, roll back if it fails), bitwise equal to the synchronous step, and gives
a sharded state dict keyed by the model's global parameter names (``checkpoint.py``), so its
state reshards with the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed.param_and_grad_buffer import shard_buffer
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

from . import gloo_on_gpu
from .post_validation import PendingState, PostValidation, Snapshot

ADAM_STATE = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class StepInfo:
    """What one optimizer step did: the global gradient norm before clipping, whether the step
    was skipped (non-finite gradients), and under post-validation whether this rank stepped
    before the global check (``optimistic``), had to roll that step back (and redo it), and
    whether the global check is still to come (``settled`` False: ``grad_norm`` is then this
    rank's partial norm, see :meth:`MainGradOptimizer.settle`)."""

    grad_norm: float
    skipped: bool = False
    optimistic: bool = False
    rolled_back: bool = False
    settled: bool = True


class MainGradOptimizer:
    """``torch.optim.AdamW`` over DDP-wrapped chunks, stepping on ``main_grad``; ``step()``
    returns the global gradient norm before clipping (``last`` holds the whole :class:`StepInfo`).

    ``post_validation``: step before the global norm and NaN/inf check (``post_validation.py``),
    same result. ``step()`` then returns as soon as this rank has stepped on the partial state
    (``chain``: the pipeline ranks in the order they finish, which the partial state follows);
    the caller must :meth:`settle` the step before the next iteration's first backward-side op,
    before the gradient buffers are zeroed, and before a checkpoint, and redo the forwards run in
    between when :meth:`settle` reports a rollback."""

    def __init__(
        self,
        model: Sequence[Any],
        settings: OptimizerSettings,
        post_validation: bool = False,
        chain: Sequence[int] | None = None,
    ) -> None:
        self.model = list(model)
        self.settings = settings
        self.params = [p for chunk in self.model for p in chunk.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            betas=settings.betas,
            eps=settings.eps,
        )
        device = self.params[0].device if self.params else torch.device("cpu")
        # post-validation's communicators created here, on every rank at once (warm_up)
        self.validation = PostValidation(chain=chain, device=device) if post_validation else None
        self.snapshot = Snapshot(self.optimizer, self.params)  # what an optimistic step overwrote
        self.last = StepInfo(0.0)
        self._pending: PendingState | None = None  # the global check of an optimistic step
        # the last post-validated step failed its global check: every rank redid it, so the
        # forwards run since (by every rank, optimistic or not) must run again
        self._check_failed = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> float:
        if self._pending is not None or self._check_failed:
            # the forwards and backwards since may have run on weights the check rolls back
            raise RuntimeError(
                "post-validation: settle() the previous step before the next one, at the next "
                "iteration's validation gate (PipelineRuntime.step(gate=...))"
            )
        gather_grad_shards(self.model)
        self._grads_from_main()
        try:
            self.last = self._synchronous_step() if self.validation is None else self._validated_step()
        finally:
            for param in self.params:
                param.grad = None
        return self.last.grad_norm

    def _grads_from_main(self) -> None:
        for param in self.params:
            param.grad = param.main_grad.to(param.dtype)

    def _synchronous_step(self) -> StepInfo:
        norm = global_grad_norm(self.params)
        if not math.isfinite(norm):
            return StepInfo(norm, skipped=True)
        self._clip(norm)
        self.optimizer.step()
        return StepInfo(norm)

    def _validated_step(self) -> StepInfo:
        """Post-validation: the optimistic step needs only the partial state of the ranks that
        finished before this one; its global check is left to :meth:`settle`. The last rank of
        the chain does not step optimistically: every other rank has issued the global
        all-reduce by then, so waiting for it costs less than the copy a rollback needs."""
        assert self.validation is not None
        pending = self.validation.begin(local_square_sum(self.params))
        if self.validation.next is not None and self._passes(math.sqrt(pending.partial)):
            self.snapshot.take()
            self.optimizer.step()
            self._pending = pending
            return StepInfo(math.sqrt(pending.partial), optimistic=True, settled=False)
        # the global state: from the last rank of the chain, or because the partial state already
        # fails (so does the global one); step as the synchronous optimizer does
        norm = pending.wait()
        self._check_failed = not self._passes(norm)
        if not math.isfinite(norm):
            return StepInfo(norm, skipped=True)
        self._clip(norm)
        self.optimizer.step()
        return StepInfo(norm)

    def settle(self) -> bool:
        """Wait for the global check of an optimistic step; if it fails, roll the step back and
        redo it as the synchronous optimizer would (skip, or clip by the global norm). The
        gradients must still be in ``main_grad``. Returns whether the global check passed, the
        same answer on every rank (False: the step was redone on the ranks that had stepped, and
        on every rank the forwards run since must be run again); ``last`` becomes the settled
        :class:`StepInfo`. Nothing to settle: True."""
        if self._pending is None:
            failed, self._check_failed = self._check_failed, False
            return not failed
        pending, self._pending = self._pending, None
        norm = pending.wait()
        if self._passes(norm):
            self.last = StepInfo(norm, optimistic=True)
            return True
        self.snapshot.restore()
        if not math.isfinite(norm):
            self.last = StepInfo(norm, skipped=True, optimistic=True, rolled_back=True)
            return False
        self._grads_from_main()
        try:
            self._clip(norm)
            self.optimizer.step()
        finally:
            for param in self.params:
                param.grad = None
        self.last = StepInfo(norm, optimistic=True, rolled_back=True)
        return False

    def _passes(self, norm: float) -> bool:
        """Whether a step on gradients of this norm is the plain step: finite and within the
        clip threshold (the synchronous step's own test)."""
        clip = self.settings.clip_grad
        return math.isfinite(norm) and not (clip > 0 and norm > clip)

    def _clip(self, norm: float) -> None:
        """Megatron's clipping by the global norm."""
        clip = self.settings.clip_grad
        if clip > 0 and norm > clip:
            for param in self.params:
                param.grad.mul_(clip / (norm + 1e-6))

    # ---- checkpoints ------------------------------------------------------------------------

    def _init_state(self) -> None:
        """The AdamW state torch creates at the first step, created now (same values) so a
        checkpoint always has it and a load has tensors to load into."""
        for param in self.params:
            state = self.optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key in ADAM_STATE:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def sharded_state_dict(self, model_sharded_state_dict: dict[str, Any], is_loading: bool = False) -> dict:
        """Adam's moments as sharded tensors keyed ``optimizer.state.<moment>.<model key>`` with
        the model parameter's sharding (global layer numbers, TP shards), so they reshard with
        the model whatever the schedule, placement or parallel sizes; the step count (the same
        for every parameter) and the hyperparameters as common state."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        self._init_state()
        sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        missing = [index for index in range(len(self.params)) if index not in sharded]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters have no sharded model tensor")
        state = {
            index: {
                key: make_sharded_optimizer_tensor(
                    sharded[index], self.optimizer.state[param][key], prefix=f"optimizer.state.{key}"
                )
                for key in ADAM_STATE
            }
            for index, param in enumerate(self.params)
        }
        steps = {float(self.optimizer.state[param]["step"]) for param in self.params}
        if len(steps) > 1:
            raise ValueError(f"parameters have different Adam step counts {sorted(steps)}")
        hyper = {key: self.settings.__dict__[key] for key in ("weight_decay", "betas", "eps")}
        return {"state": state, "step": steps.pop() if steps else 0.0, "hyperparameters": hyper}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Take the loaded :meth:`sharded_state_dict` (tensors loaded, common values read)."""
        self._init_state()
        for index, param in enumerate(self.params):
            state = self.optimizer.state[param]
            for key in ADAM_STATE:
                loaded = state_dict["state"][index][key]
                if loaded is not state[key]:
                    state[key].copy_(loaded)
            state["step"] = torch.tensor(float(state_dict["step"]), dtype=torch.float32)


def gather_grad_shards(model: Sequence[Any]) -> None:
    """Under the distributed optimizer's layout, all-gather each bucket's reduced shards so every
    data-parallel rank holds the whole reduced gradient."""
    for chunk in model:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in chunk.bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[rank].clone()
                gloo_on_gpu.staged_all_gather_into_tensor(
                    bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group
                )


def local_square_sum(params: Sequence[torch.Tensor], main_grad: bool = False) -> torch.Tensor:
    """This rank's share of the squared gradient norm (float64) of ``.grad`` (or ``.main_grad``),
    each tensor-parallel duplicate (norm weights) counted on one rank only; a NaN or inf makes it
    non-finite."""
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        grad = getattr(param, "main_grad", None) if main_grad else param.grad
        if grad is not None and param_is_not_tensor_parallel_duplicate(param):
            total += grad.double().pow(2).sum()
    return total


def global_grad_norm(params: Sequence[torch.Tensor], main_grad: bool = False) -> float:
    """L2 norm of every gradient of the model: squares summed over the tensor- and pipeline-
    parallel ranks, each tensor-parallel duplicate (norm weights) counted once. Routed experts
    (megatron-core marks their weights ``allreduce=False``) differ across expert-parallel ranks:
    theirs are summed over the expert-tensor, expert and pipeline ranks, as Megatron's optimizer
    for expert weights sums them (with EP 1 and expert TP = TP that is the same group)."""
    if not experts_split_otherwise():
        total = local_square_sum(params, main_grad)
        gloo_on_gpu.staged_all_reduce(total, group=parallel_state.get_model_parallel_group())
        return float(total.sqrt())
    dense = local_square_sum([param for param in params if getattr(param, "allreduce", True)], main_grad)
    gloo_on_gpu.staged_all_reduce(dense, group=parallel_state.get_model_parallel_group())
    routed = local_square_sum([param for param in params if not getattr(param, "allreduce", True)], main_grad)
    gloo_on_gpu.staged_all_reduce(
        routed, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    )
    return float((dense + routed).sqrt())


def experts_split_otherwise() -> bool:
    """Whether routed experts are split over other ranks than the dense weights: EP > 1, or an
    expert tensor-parallel size other than TP."""
    return parallel_state.get_expert_model_parallel_world_size() > 1 or (
        parallel_state.get_expert_tensor_parallel_world_size()
        != parallel_state.get_tensor_model_parallel_world_size()
    )


def main_grads_finite(model: Sequence[Any]) -> tuple[bool, float]:
    """Whether the reduced gradients (``main_grad``) are finite on every model-parallel rank,
    and their global norm: the check Megatron's own optimizer lacks for fp32/bf16."""
    norm = global_grad_norm([p for chunk in model for p in chunk.parameters() if p.requires_grad], True)
    return math.isfinite(norm), norm


def optimizer_kind(requested: str, post_validation: bool, cuda: bool) -> str:
    """ "megatron" or "torch": what ``--pp-optimizer`` (``requested``) builds on this machine."""
    if requested == "megatron" and (post_validation or not cuda):
        raise ValueError("megatron-core's optimizer needs CUDA and cannot be post-validated")
    if requested == "auto":
        return "torch" if post_validation or not cuda else "megatron"
    return requested


def build_optimizer(
    model: Sequence[Any],
    settings: OptimizerSettings,
    bf16: bool = False,
    post_validation: bool = False,
    chain: Sequence[int] | None = None,
    kind: str = "auto",
) -> Any:
    """Megatron's optimizer on GPU, :class:`MainGradOptimizer` on CPU (see the module docstring)
    and wherever ``post_validation`` is asked for (Megatron's optimizer cannot roll a step back;
    ``chain``: the pipeline ranks in the order they finish an iteration); ``kind`` ("megatron",
    "torch") picks one (``--pp-optimizer``: post-validation against the same optimizer without
    it). Both have ``param_groups`` and a ``step()``; Megatron's returns (ok, grad norm, zeros)."""
    if optimizer_kind(kind, post_validation, torch.cuda.is_available()) == "torch":
        return MainGradOptimizer(model, settings, post_validation=post_validation, chain=chain)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=model[0].ddp_config.use_distributed_optimizer,
    )
    # the parallel state has no gloo groups (they serve only Megatron-LM's legacy checkpoint
    # formats; ours is dist_checkpointing's)
    return get_megatron_optimizer(config, list(model), use_gloo_process_groups=False)


def optimizer_step(optimizer: Any, model: Sequence[Any] | None = None) -> StepInfo:
    """One step, whichever optimizer it is; a step with non-finite gradients is skipped. For
    Megatron's optimizer (no skip without a loss scaler) ``model`` lets the gradients be checked
    first."""
    if isinstance(optimizer, MainGradOptimizer):
        optimizer.step()
        return optimizer.last
    if model is not None:
        finite, norm = main_grads_finite(model)
        if not finite:
            return StepInfo(norm, skipped=True)
    result = optimizer.step()
    if isinstance(result, tuple):
        return StepInfo(float(result[1]), skipped=not result[0])
    return StepInfo(float(result))
