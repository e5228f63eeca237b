"""The B/W split on CUDA: one model chunk's backward as B then W against the unsplit backward, bf16.

Zero-bubble schedules (zb-h1, zb-h2, v-zb, ...) run a chunk's backward as two ops: B computes the
input gradient only, and every linear layer of the chunk defers its weight-gradient GEMM to the
chunk's WeightGradStore; W replays them later (megatron_pp_ext/runtime/weight_grad.py,
``StageRunner.backward(split=True)`` and ``StageRunner.weight``). On CPU
tests/test_runtime_model.py (``test_b_then_w_equals_bw``) checks this in float32; this script runs
the same check with the same public pieces on the GPU's kernels in bf16, for the first, a middle
and the last stage of a small Llama-style megatron-core model (GQA, SwiGLU, the local layer spec).

The split changes when the weight-gradient GEMMs run, not what they compute, so every parameter's
gradient and the stage input's gradient must agree with the unsplit backward's within one bf16
epsilon, relative to the gradient's norm (the script reports how many are bitwise equal); B must
leave every deferrable linear's weight gradient untouched, and W must leave nothing pending.

``--spec te``: the same on Transformer Engine's layer spec, whose linears defer through TE's own
``delay_wgrad_compute`` queue and ``backward_dw`` (``runtime/te_wgrad.py``; on CPU,
tests/test_te_wgrad.py checks it against a double of TE). SKIP without TE, or with a TE older
than the plugin's refusal names.
"""

from __future__ import annotations

import argparse

import common

MICRO_BATCH = 2
STAGES = 3  # one layer each: the first (embedding), a middle one, the last (output layer and loss)
MODEL = dict(
    hidden_size=1024, num_attention_heads=16, num_kv_heads=4, ffn_hidden_size=2816, vocab_size=4096,
    seq_length=1024, dtype="bfloat16",
)  # fmt: skip


def batch(model, device):
    import torch

    shape = (MICRO_BATCH, model.seq_length)
    return {
        "tokens": torch.randint(0, model.vocab_size, shape, device=device),
        "labels": torch.randint(0, model.vocab_size, shape, device=device),
        "loss_mask": torch.ones(shape, device=device),
        "position_ids": torch.arange(model.seq_length, device=device).expand(MICRO_BATCH, -1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", choices=("local", "te"), default="local")
    use_te = parser.parse_args().spec == "te"
    device = common.need_cuda()
    common.init_one_process()
    import torch

    if use_te:
        from megatron_pp_ext.megatron.layer_spec import te_available, te_wgrad_refusal

        if not te_available():
            common.skip("Transformer Engine does not import: the TE spec cannot be built")
        refusal = te_wgrad_refusal("the B/W split")
        if refusal is not None:
            common.skip(refusal)
    from megatron_pp_ext.megatron.model import ModelConfig, build_stage, split_layers
    from megatron_pp_ext.megatron.steps import forward_step
    from megatron_pp_ext.runtime.memory import ActivationMeter
    from megatron_pp_ext.runtime.stage import LossRecord, StageRunner
    from megatron_pp_ext.runtime.te_wgrad import te_store
    from megatron_pp_ext.runtime.weight_grad import (
        DeferrableColumnParallelLinear,
        DeferrableRowParallelLinear,
        WeightGradStore,
    )

    model = ModelConfig(num_layers=STAGES, **MODEL)
    tolerance = torch.finfo(torch.bfloat16).eps
    layers = split_layers(model.num_layers, STAGES)
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    problems, worst = [], 0.0
    for stage in range(STAGES):
        torch.manual_seed(stage)
        chunk = build_stage(model, stage, layers, use_te=use_te, defer_te_wgrad=use_te)
        where = next(chunk.parameters()).device
        if where.type != device.type:
            common.fail(f"stage {stage} was built on {where}, not on {device}")
        data = batch(model, device)
        stage_input = None if stage == 0 else torch.randn(shape, device=device, dtype=torch.bfloat16)
        output_grad = None if stage == STAGES - 1 else torch.randn(shape, device=device, dtype=torch.bfloat16)
        grads = {}
        for split in (False, True):
            chunk.zero_grad(set_to_none=True)
            store = WeightGradStore()
            runner = StageRunner(chunk, stage, STAGES, chunk.config, ActivationMeter(), store)
            deferrable = (DeferrableColumnParallelLinear, DeferrableRowParallelLinear)  # the output layer too
            linears = [  # now that the runner made them; TE's linears with their own store
                m for m in chunk.modules() if isinstance(m, deferrable) or te_store(m) is not None
            ]
            te_linears = [m for m in linears if te_store(m) is not None]
            if use_te and not te_linears:
                problems.append(f"stage {stage}: no Transformer Engine linear in the TE spec's chunk")
            runner.forward((0, 0), stage_input, forward_step, iter([data]), 1, LossRecord())
            input_grad = runner.backward((0, 0), output_grad, split=split)
            if split:
                weights = [w for m in linears for w in _weights(m)]
                touched = [w for w in weights if w.grad is not None]
                if touched:
                    problems.append(f"stage {stage}: B computed {len(touched)} linear weight gradients")
                # counted as the CPU test counts, plus what TE queued
                deferred = len(store._pending.get((0, 0), [])) + sum(_queued(m) for m in te_linears)
                runner.weight((0, 0))
                if store.pending() or any(_queued(m) for m in te_linears):
                    problems.append(f"stage {stage}: W left {store.pending()} pending")
            torch.cuda.synchronize(device)
            grads[split] = ({n: p.grad for n, p in chunk.named_parameters()}, input_grad)
        names = list(grads[False][0])
        missing = [n for n in names if grads[False][0][n] is None or grads[True][0][n] is None]
        if missing:
            problems.append(f"stage {stage}: no gradient for {missing[:3]}")
            continue
        errors = {n: common.rel_error(grads[True][0][n], grads[False][0][n]) for n in names}
        bitwise = sum(torch.equal(grads[True][0][n], grads[False][0][n]) for n in names)
        input_error = 0.0 if stage == 0 else common.rel_error(grads[True][1], grads[False][1])
        name = max(errors, key=errors.get)
        print(
            f"stage {stage}: {len(names)} parameters ({len(linears)} deferrable linears, {deferred} "
            f"gradients deferred by B), {bitwise} bitwise equal; worst relative error {errors[name]:.2e} "
            f"({name}); input gradient relative error {input_error:.2e}",
            flush=True,
        )
        worst = max(worst, errors[name], input_error)
        if deferred < len(linears):
            problems.append(f"stage {stage}: B deferred {deferred} gradients for {len(linears)} linears")
    print(f"worst relative error {worst:.2e}, tolerance (one bf16 epsilon) {tolerance:.2e}")
    if problems:
        common.fail("; ".join(problems))
    if worst > tolerance:
        common.fail(f"B then W differs from BW by {worst:.2e} > {tolerance:.2e} (relative to the norm)")
    spec = "Transformer Engine" if use_te else "local"
    common.passed(
        f"B then W equals BW on {STAGES} stages ({spec} spec) in bf16: worst relative error {worst:.1e}"
    )


def _weights(module):
    """A linear's weights (a TE linear's ``weight_names``; its layer-norm weight is not one)."""
    names = getattr(module, "weight_names", None) or ("weight",)
    return [w for name in names if (w := getattr(module, name, None)) is not None]


def _queued(module) -> int:
    from megatron_pp_ext.runtime.te_wgrad import te_store

    store = te_store(module)
    return 0 if store is None else store.context.qsize()


if __name__ == "__main__":
    main()
