"""Megatron-LM's ``--use-pytorch-profiler`` for ``train``: torch.profiler over the profiling
window (``--profile-step-start`` .. ``--profile-step-end``), its trace written to
``--tensorboard-dir`` as Megatron-LM writes it. The runtime names every op of the step
(``runtime/timeline.py`` ``OpRanges``), so the trace shows the schedule."""

from __future__ import annotations

from typing import Any


def pytorch_profiler(settings: Any) -> Any:
    """A started ``torch.profiler.profile`` with Megatron-LM's window (None without the flag);
    call ``.step()`` after each iteration and ``.stop()`` at the end."""
    if not settings.use_pytorch_profiler:
        return None
    import torch

    start, end = settings.pipeline.profile_step_start, settings.pipeline.profile_step_end
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(
            wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1
        ),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(settings.tensorboard_dir),
        record_shapes=True,
    )
    profiler.start()
    return profiler
