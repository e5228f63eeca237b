"""What the GPU validation scripts share: how a script reports its result, and one-process setup.

Each script under ``scripts/gpu/`` is one step of ``scripts/gpu_validate.sh``. It prints its
figures, then ends with one line that ``gpu_validate.sh`` records: ``PASS: ...`` (exit 0),
``FAIL: ...`` (exit 1) or ``SKIP: ...`` (exit 77, a prerequisite is missing and the line says
which). An uncaught exception is a failure too; its last line is the reason recorded.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[2]
# the project from the working tree, and scripts/ (bench_offload.py, bench_sliced_attention.py)
for _path in (REPO / "scripts", REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

SKIP_EXIT = 77


def passed(summary: str) -> None:
    print(f"PASS: {summary}", flush=True)


def fail(reason: str) -> NoReturn:
    print(f"FAIL: {reason}", flush=True)
    sys.exit(1)


def skip(reason: str) -> NoReturn:
    print(f"SKIP: {reason}", flush=True)
    sys.exit(SKIP_EXIT)


def need_cuda() -> Any:
    """The first CUDA device, or a SKIP when there is none."""
    import torch

    if not torch.cuda.is_available():
        skip("no CUDA device (torch.cuda.is_available() is False)")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def init_one_process(seed: int = 1234) -> None:
    """torch.distributed with one rank (gloo, as scripts/bench_offload.py) and Megatron's parallel
    state at TP = PP = CP = 1. Megatron initialises weights on the GPU inside its CUDA RNG
    tracker's "model-parallel-rng" state, which only ``model_parallel_cuda_manual_seed`` adds
    (Megatron-LM's initialize calls it); it is seeded here the same way."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from megatron_pp_ext.megatron.model import init_parallel_state

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_parallel_state(1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rel_error(value: Any, reference: Any) -> float:
    """||value - reference|| / ||reference|| in float64 (as tests/runtime_case.py computes it)."""
    value, reference = value.double(), reference.double()
    norm = reference.norm().item()
    difference = (value - reference).norm().item()
    return difference if norm == 0.0 else difference / norm


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
