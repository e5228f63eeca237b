"""Activation offload on CUDA under the CUDA sanitizer: gradients bitwise equal to no offload.

PipeOffload's OFFLOAD and RELOAD ops (megatron_pp_ext/runtime/offload.py) copy what a unit's
forward saved to pinned host buffers on a device-to-host stream and back on a host-to-device
stream, ordered against the compute stream by events. A missing wait is a data race (a backward
reading a buffer before its reload landed, a reload overwriting a host buffer still being copied
out) that CPU tests cannot see: there the copies are synchronous. Run with
``TORCH_CUDA_SANITIZER=1`` (``gpu_validate.sh`` does), torch's CUDA sanitizer checks the streams
every kernel and copy touch and raises on an unsynchronised access.

One pipeline rank in one process, as scripts/bench_offload.py runs it (its op order, data and
forward step are reused): rank 0's op order of 1F1B over 4 stages, so 4 microbatches are in flight,
on a small Llama-style model in bf16; once without copies, once more without (a control: a
bitwise comparison needs the GPU's kernels to repeat themselves, deterministic algorithms are on)
and twice with ``--pp-offload full`` (the second step reuses the host pool). Every parameter's
gradient and every microbatch's loss must be bitwise equal to the first run's, and the copies must
have moved something.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import common  # noqa: E402 (after the cuBLAS setting)

DEPTH, MICROBATCHES, MICRO_BATCH = 4, 4, 2
MODEL = dict(
    num_layers=2, hidden_size=512, num_attention_heads=8, num_kv_heads=4, ffn_hidden_size=1408,
    vocab_size=2048, seq_length=512, dtype="bfloat16",
)  # fmt: skip


def main() -> None:
    import torch
    import torch.cuda._sanitizer as csan

    device = common.need_cuda()
    if not csan.cuda_sanitizer.enabled:
        common.fail("the CUDA sanitizer is off: run with TORCH_CUDA_SANITIZER=1 in the environment")
    print("CUDA sanitizer: on (torch.cuda._sanitizer, enabled at import by TORCH_CUDA_SANITIZER=1)")
    torch.use_deterministic_algorithms(True, warn_only=True)
    common.init_one_process()
    from bench_offload import batches, forward_step, rank0_of_1f1b

    from megatron_pp_ext.megatron.model import ModelConfig, build_stage
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.schedule.offload import OffloadPolicy, apply_offload

    model = ModelConfig(**MODEL)
    torch.manual_seed(0)
    chunk = build_stage(model, 0, [model.num_layers])
    data = batches(model, MICRO_BATCH, MICROBATCHES, device)
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    runtime = PipelineRuntime([chunk], PipeComm(timeout_s=300), shape, model.torch_dtype)
    plain = rank0_of_1f1b(DEPTH, MICROBATCHES)
    offloaded = apply_offload(plain, OffloadPolicy("full"))
    print(f"schedule: {' '.join(str(op) for op in offloaded.ranks[0])}")

    def run(schedule):
        chunk.zero_grad(set_to_none=True)
        result = runtime.step(schedule, forward_step, iter(data))
        torch.cuda.synchronize(device)
        grads = [p.grad.clone() for p in chunk.parameters()]
        losses = torch.stack([item["lm loss"] for item in result.losses])
        return grads, losses, result

    reference = run(plain)
    runs = {
        "control (no offload)": run(plain),
        "offload, step 1": run(offloaded),
        "offload, step 2": run(offloaded),
    }
    unequal = []
    for name, (grads, losses, result) in runs.items():
        same = sum(torch.equal(a, b) for a, b in zip(grads, reference[0]))
        losses_same = torch.equal(losses, reference[1])
        worst = max(common.rel_error(a, b) for a, b in zip(grads, reference[0]))
        stats = result.offload
        moved = ""
        if stats is not None:
            moved = (
                f", offloaded {stats.offloaded_bytes / 2**20:.1f} MiB in {stats.offload_copies} copies, "
                f"reloaded {stats.reloaded_bytes / 2**20:.1f} MiB, "
                f"{stats.host_buffers_allocated} new host buffers"
            )
        print(
            f"{name}: {same}/{len(grads)} gradients bitwise equal (worst relative error {worst:.1e}), "
            f"losses {'equal' if losses_same else 'differ'}, peak activation "
            f"{result.peak_activation_bytes / 2**20:.1f} MiB{moved}",
            flush=True,
        )
        if same != len(grads) or not losses_same:
            unequal.append(name)
    stats = runs["offload, step 1"][2].offload
    if stats is None or stats.offloaded_bytes == 0:
        common.fail("the offload runs copied nothing: the check would prove nothing")
    if "control (no offload)" in unequal:
        common.fail(
            "two runs without offload already differ: the GPU's kernels are not deterministic here, "
            f"so a bitwise comparison cannot be made (also unequal: {unequal[1:] or 'none'})"
        )
    if unequal:
        common.fail(f"gradients or losses not bitwise equal to the run without offload: {', '.join(unequal)}")
    common.passed(
        f"bitwise equal with full offload ({stats.offloaded_bytes / 2**20:.1f} MiB per step), "
        "under the CUDA sanitizer, no race reported"
    )


if __name__ == "__main__":
    main()
