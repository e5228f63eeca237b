"""The runtime: executes one rank's lowered schedule on megatron-core model chunks.

Entry points: :class:`PipelineRuntime` (built once per rank with its chunks and a
:class:`PipeComm`; ``step(schedule, forward_step_func, data_iterators)`` runs one step) and
:func:`forward_backward` (the same with Megatron's ``forward_backward_func`` arguments)::

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    init_parallel_state(pp, tp, cp)                       # TP x CP x PP x DP from Megatron's parallel_state
    schedule = generate("zb-h1", pp, microbatches)
    chunks = build_chunks(model_config, schedule.placement, rank)   # GPTModel per virtual stage
    pipeline = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    runtime = PipelineRuntime(chunks, PipeComm(pipeline, timeout_s=300), (seq, micro_batch, hidden), dtype)
    result = runtime.step(schedule, forward_step_func, [iter(data) for _ in chunks])
    optimizer.step()                                      # grads are in .grad / .main_grad

``result.losses`` holds the loss dicts on the rank of the last virtual stage (rank 0 for V-shape
schedules); ``result.peak_activation_bytes`` the rank's activation peak.

Sequence-sliced schedules (``generate(..., slices=k)``) need chunks from
``build_chunks(..., sliced=True)``; ``tensor_shape`` stays the whole microbatch's and the
iterators yield whole microbatches: ``slicing.py`` cuts both per slice.
"""

from .api import forward_backward
from .executor import PipelineError, PipelineRuntime, StepResult, prepare
from .memory import ActivationMeter, OpMemory, measure_op_memory
from .p2p import PeerError, PipeComm
from .reference import reference_step
from .weight_grad import WeightGradStore

__all__ = [
    "ActivationMeter",
    "OpMemory",
    "PeerError",
    "PipeComm",
    "PipelineError",
    "PipelineRuntime",
    "StepResult",
    "WeightGradStore",
    "forward_backward",
    "measure_op_memory",
    "prepare",
    "reference_step",
]
