"""The runtime: executes one rank's lowered schedule on megatron-core model chunks.

Entry points: :class:`PipelineRuntime` (built once per rank with its chunks and a
:class:`PipeComm`; ``step(schedule, forward_step_func, data_iterators)`` runs one step) and
:func:`forward_backward` (the same with Megatron's ``forward_backward_func`` arguments).
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
