"""Overlapped pairs on real chunks: the expert all-to-all of one microbatch hidden behind another's
compute, through megatron-core's own per-layer schedule plan.

With pairing on (the schedule's ``meta["pairs"]``, ``schedule/pairing.py``) every F of a step
builds megatron-core's ``TransformerModelChunkSchedulePlan``: the user's ``forward_step_func``
is called with ``return_schedule_plan=True``, as megatron-core's combined 1F1B calls it, and
``GPTModel.build_schedule_plan`` cuts each layer into nodes: attention (with the router and the
dispatch preprocess), dispatch, MLP (the experts), combine; a dense layer's dispatch and combine
are megatron-core's no-op nodes. A B (or BW) runs the nodes of its F's plan backward. An F and a
B that the schedule pairs run together (:func:`run_plans`), the F's layer ``i`` beside the B's
layer ``n - 1 - i``, in combined 1F1B's order per layer::

    communication: combine_bwd(B) | dispatch_fwd(F) | dispatch_bwd(B) | combine_fwd(F)
    compute:       attn_fwd(F)    | mlp_bwd(B)      | mlp_fwd(F)      | attn_bwd(B)

The communication nodes go to a :class:`CommLane`. On a GPU they are launched in place: each
node runs on megatron-core's communication stream and its events order it after its
microbatch's previous node. On the host a single communication thread runs them in the order
they are submitted (each rank of an expert group submits the group's all-to-alls in the same
order, the schedule's) while the main thread computes, so the overlap is real on gloo too; the
main thread waits for a node's result only where the next node needs it.

Weight gradients stay where the schedule puts them: inside a B the chunk's linears defer theirs
to the W op (``weight_grad.py``), inside a BW they are computed in place; megatron-core's
``backward_dw`` (its ``delay_wgrad_compute``) is not called, since our W pass takes those
gradients (Transformer Engine's deferred ones through the store too). Parameters outside the
linears (norms, the router, the embedding) get theirs at the node's backward, as megatron-core's
nodes accumulate them.

:func:`check_pairing` refuses, in one line each, what the pairs do not compose with.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the flag checks run before torch is imported (train's early checks)
    from torch import Tensor

FLAG = "--overlap-moe-expert-parallel-comm"


class CommLane:
    """Where a plan's communication nodes run: a thread of its own on the host, in place on a
    GPU (megatron-core's node puts its work on the communication stream)."""

    def __init__(self, on_host: bool, timeout_s: float = 300.0) -> None:
        from megatron.core.pipeline_parallel.utils import set_streams

        set_streams()  # megatron-core's computation and communication streams (the host's: no-ops)
        self._thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="pp-expert-comm") if on_host else None
        )
        self.timeout_s = timeout_s  # how long the main thread waits for a node (--pp-p2p-timeout)
        self.nodes = 0  # communication nodes run (dispatch and combine, forward and backward)

    def run(self, node: Any, value: Any) -> Future:
        """``node.forward``/``backward`` (a bound method) of ``value``, as a future."""
        if _is_noop(node):
            done: Future = Future()
            done.set_result(node(value))
            return done
        self.nodes += 1
        if self._thread is None:
            done = Future()
            done.set_result(node(value))
            return done
        return self._thread.submit(node, value)

    def result(self, future: Future, node: Any) -> Any:
        """The node's output, waited for at most ``timeout_s``: a peer of the expert group that
        never joins its all-to-all fails the op, naming the node, not a silent hang."""
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            name = getattr(getattr(node, "__self__", None), "name", "communication node")
            raise TimeoutError(
                f"the expert all-to-all of megatron-core's {name} node did not complete within "
                f"{self.timeout_s:g} s (--pp-p2p-timeout): a rank of the expert-parallel group "
                "did not join it"
            ) from None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)


def _is_noop(bound: Callable[..., Any]) -> bool:
    from megatron.core.pipeline_parallel.utils import NoopScheduleNode

    return isinstance(getattr(bound, "__self__", None), NoopScheduleNode)


def run_plans(f_plan: Any, b_plan: Any, b_grad: Tensor | None, lane: CommLane) -> Tensor | None:
    """Run ``f_plan`` forward and ``b_plan`` backward from ``b_grad`` (either may be None: a
    single F or B), as megatron-core's ``TransformerModelChunkSchedulePlan.run`` does, with the
    communication nodes on ``lane``. Returns the forward's output (None without ``f_plan``);
    the backward leaves the input gradient in its input's ``.grad``."""
    value = f_plan.pre_process.forward() if f_plan is not None else None
    if b_plan is not None and b_plan.post_process is not None:
        b_grad = b_plan.post_process.backward(b_grad)
    forwards = [f_plan.get_layer(i) for i in range(f_plan.num_layers())] if f_plan is not None else []
    backwards = [b_plan.pop_layer() for _ in range(b_plan.num_layers())] if b_plan is not None else []
    for f_layer, b_layer in itertools.zip_longest(forwards, backwards):
        value, b_grad = _run_layers(f_layer, b_layer, value, b_grad, lane)
        if b_layer is not None:
            b_layer.release_state()
    if f_plan is not None and f_plan.post_process is not None:
        value = f_plan.post_process.forward(value)
    if b_plan is not None:
        b_plan.pre_process.backward(b_grad)
        b_plan.release_state()
    return value


def _run_layers(f: Any, b: Any, value: Any, grad: Any, lane: CommLane) -> tuple[Any, Any]:
    """One layer's forward (``f``) beside another layer's backward (``b``); each communication
    node is submitted as soon as its input is ready, so it runs beside the other's compute."""
    if b is not None:
        grad = lane.run(b.moe_combine.backward, b.mtp_post_process.backward(grad))
    if f is not None:
        with f.get_fp8_context():
            value = lane.run(f.moe_dispatch.forward, f.attn.forward(value))
    if b is not None:
        grad = lane.run(b.moe_dispatch.backward, b.mlp.backward(lane.result(grad, b.moe_combine.backward)))
    if f is not None:
        with f.get_fp8_context():
            value = lane.run(f.moe_combine.forward, f.mlp.forward(lane.result(value, f.moe_dispatch.forward)))
    if b is not None:
        grad = b.attn.backward(lane.result(grad, b.moe_dispatch.backward))
    if f is not None:
        with f.get_fp8_context():
            value = f.mtp_post_process.forward(lane.result(value, f.moe_combine.forward))
    return value, grad


def takes_schedule_plan(forward_step_func: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(forward_step_func).parameters
    except (TypeError, ValueError):
        return True  # cannot tell: megatron-core would call it the same way
    return "return_schedule_plan" in parameters or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def config_refusal(config: Any, on_host: bool) -> str | None:
    """Why the model config (a TransformerConfig, or anything with its field names) cannot run
    overlapped pairs, in one line naming the flag and the fix; None if it can. Megatron's own
    preconditions (EP > 1, the alltoall or flex dispatcher, no full recomputation) and ours."""
    if getattr(config, "num_moe_experts", None) is None:
        return "the model has no experts (--num-experts): drop the flag"
    if int(getattr(config, "expert_model_parallel_size", 1) or 1) < 2:
        return "needs --expert-model-parallel-size 2 or more: with EP 1 there is no all-to-all to hide"
    if getattr(config, "moe_token_dispatcher_type", None) not in ("alltoall", "flex"):
        return "needs --moe-token-dispatcher-type alltoall or flex (megatron-core's plan splits only those)"
    if getattr(config, "recompute_granularity", None) == "full" or getattr(config, "recompute_method", None):
        return (
            "does not run with full recomputation: drop --recompute-granularity full and --recompute-method"
        )
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        return (
            "does not run with --num-microbatches-with-partial-activation-checkpoints "
            "(megatron-core's neither)"
        )
    if int(getattr(config, "tensor_model_parallel_size", 1) or 1) > 1 and on_host:
        return (
            "on the host the all-to-alls run on a thread of their own, where the dispatcher's "
            "tensor-parallel collectives would race the main thread's: use --tensor-model-parallel-size 1"
        )
    if int(getattr(config, "context_parallel_size", 1) or 1) > 1:
        return "not with context parallelism yet: use --context-parallel-size 1"
    if getattr(config, "mtp_num_layers", None):
        return "not with multi-token prediction layers yet: drop --mtp-num-layers"
    return None


def check_pairing(
    config: Any, schedule: Any, chunks: list[Any], forward_step_func: Callable[..., Any]
) -> None:
    """What overlapped pairs need, each refused in one line naming the flag and the fix."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.utils import get_attr_wrapped_model

    def refuse(why: str) -> None:
        raise ValueError(f"{FLAG}: {why}")

    why = config_refusal(config, _on_host(chunks))
    if why is not None:
        refuse(why)
    if schedule.slices > 1:
        refuse(f"not with sequence slices ({schedule.name} with {schedule.slices}): use an unsliced schedule")
    if schedule.vocab_parallel != "none":
        refuse("not with --pp-vocab-parallel: its collectives are not in the pair's order")
    if any(op.is_copy for _, _, op in schedule.all_ops()):
        refuse("not with activation offload: drop --pp-offload")
    if not takes_schedule_plan(forward_step_func):
        refuse(
            "forward_step_func must accept return_schedule_plan=True and return "
            "(model.build_schedule_plan(...), loss_func), as Megatron-LM's pretrain_gpt.py does"
        )
    for chunk in chunks:
        if not isinstance(
            get_attr_wrapped_model(chunk, "build_schedule_plan", return_model_obj=True), GPTModel
        ):
            refuse(
                "the model chunks must be megatron-core GPTModels (their build_schedule_plan cuts the layers)"
            )


def _on_host(chunks: list[Any]) -> bool:
    return all(p.device.type != "cuda" for chunk in chunks for p in chunk.parameters())
