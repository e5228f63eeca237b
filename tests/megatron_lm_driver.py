"""Megatron-LM's training pieces on CPU, driven by torchrun: the patched ``pretrain_gpt.py``'s
model provider through Megatron's ``get_model``, its datasets and ``get_batch``, and Megatron's
``train_step`` running the installed schedule (with ``--pp-vocab-parallel``, the shards the
model provider set up: initialised and reported as the tables of a run without it).

Run as ``torchrun --nproc-per-node N tests/megatron_lm_driver.py MODE OUT -- <pretrain_gpt.py
flags>`` with the patched Megatron-LM tree on PYTHONPATH. MODE ``chunks`` writes, per rank, what
each chunk Megatron built holds; MODE ``train`` runs ``train_iters`` train steps and writes the
losses Megatron's ``train_step`` reports and the final weights by global name; MODE ``save`` does
the same, then Megatron-LM's ``save_checkpoint``; MODE ``load`` runs Megatron-LM's
``load_checkpoint`` and writes the weights it loaded.

The CPU shim (test-only; Megatron-LM's training package assumes CUDA in these places, none of
which the patch touches):

1. ``_initialize_distributed`` creates the model-parallel groups only when CUDA devices exist:
   this driver calls ``parallel_state.initialize_model_parallel`` first, with the same sizes.
2. ``get_model`` and ``get_batch`` move chunks and batches with ``.cuda()``: made a no-op; and
   ``get_model``'s DDP wrapping runs on
   a CUDA stream: chunks are wrapped by ``megatron_pp_ext.megatron.ddp.wrap_chunks`` (megatron-
   core's DDP, configured as training.py configures it) instead.
3. The legacy fused CUDA kernels (``fused_kernels.load``) are not built.
4. ``get_megatron_optimizer`` needs CUDA: :class:`CpuOptimizer` gives ``train_step`` the
   interface it calls (zero_grad, step -> (ok, grad norm, zeros)) over the project's CPU AdamW,
   and the learning-rate scheduler is a constant (:class:`ConstantLR`).
5. The data-iterator builder broadcasts flags from a CUDA tensor: the driver builds the datasets
   and data loaders with Megatron's ``build_train_valid_test_datasets`` and
   ``build_pretraining_data_loader`` itself.
6. ``initialize_megatron`` runs ``make`` on the dataset index helpers, whose Makefile names the
   module after ``python3-config`` (which may be another Python than this venv's) and needs
   pybind11: the test copies the installed megatron-core's helpers (same release, built for this
   interpreter) into the tree, and the driver skips the ``make`` once they import.
7. ``validate_args`` asks ``torch.cuda`` for the device's compute capability under TP or CP > 1
   (to require CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell): answered as a Blackwell device.
8. MODE ``save``: ``save_checkpoint`` reads ``torch.cuda.get_rng_state()`` even with
   --no-save-rng (answered with an empty state), and its ``torch_dist`` writer forks CUDA-syncing
   writer processes: the plugin's in-process DCP writer of the same format is used
   (``megatron_pp_ext.megatron.checkpoint._save_strategy``).
9. MODE ``load``: ``load_checkpoint`` reads the tracker file through a CUDA all-reduce: the tracker
   is set aside while it loads ``--ckpt-step``.
Plus ``megatron_pp_ext.megatron.cpu_shim`` (torch.cuda.current_device -> CPU, no-op RNG tracker).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zlib
from functools import partial

import torch
import torch.distributed as dist


class CpuOptimizer:
    """What ``train_step`` calls on Megatron's optimizer, over the project's CPU AdamW."""

    def __init__(self, model: list, lr: float) -> None:
        from megatron_pp_ext.megatron.optimizer import MainGradOptimizer, OptimizerSettings

        self.inner = MainGradOptimizer(model, OptimizerSettings(lr=lr, clip_grad=1.0, weight_decay=0.0))

    def zero_grad(self) -> None:
        pass  # train_step clears the grad buffers itself (zero_grad_buffer)

    def step(self) -> tuple[bool, float, None]:
        return True, self.inner.step(), None


class ConstantLR:
    def step(self, increment: int) -> None:
        pass


def global_name(name: str, layer_numbers: list[int]) -> str:
    """``decoder.layers.{i}.x`` of a chunk -> the same name with the model's global layer index."""
    match = re.match(r"(.*decoder\.layers\.)(\d+)(\..*)", name)
    if not match:
        return name
    return f"{match.group(1)}{layer_numbers[int(match.group(2))] - 1}{match.group(3)}"


def named_global_params(model: list) -> dict[str, torch.nn.Parameter]:
    """Parameters by global name; a tensor-parallel shard's name ends in ``@tp<rank>``."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = {}
    for chunk in model:
        inner = unwrap_model(chunk)
        numbers = [layer.layer_number for layer in inner.decoder.layers]
        for name, param in inner.named_parameters():
            shard = f"@tp{tp_rank}" if getattr(param, "tensor_model_parallel", False) else ""
            params[global_name(name, numbers) + shard] = param
    return params


def init_by_name(model: list) -> None:
    """Weights from each parameter's global name, so any placement holds the same model (with
    the same tensor-parallel size: each shard draws from its own name)."""
    with torch.no_grad():
        for name, param in named_global_params(model).items():
            param.copy_(value_by_name(name, param.shape).to(param.dtype))


def value_by_name(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 value :func:`init_by_name` gives the parameter of this global name."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    return 1.0 + 0.1 * noise if "norm" in name else 0.05 * noise


def init_vocab_by_name(vocab: object) -> None:
    """``--pp-vocab-parallel``: the shards from the tables :func:`init_by_name` gives a run without
    it (each TP rank's shard of the embedding and output tables drawn from its own name)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    rows = vocab.vp.partition.vocab_size // parallel_state.get_tensor_model_parallel_world_size()
    shape = (rows, vocab.vp.hidden_size)
    vocab.vp.load_tp_shards(
        embedding=value_by_name(f"embedding.word_embeddings.weight@tp{tp_rank}", shape),
        output=value_by_name(f"output_layer.weight@tp{tp_rank}", shape),
    )


def vocab_weights(vocab: object) -> dict[str, list]:
    """The shards gathered into the tables a run without vocabulary parallelism holds, under the
    names :func:`named_global_params` gives them there (``@tp<rank>`` per tensor-parallel shard)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    weights = {}
    for which, name in (("embedding", "embedding.word_embeddings.weight"), ("output", "output_layer.weight")):
        full = vocab.vp.gather_full(which)[: vocab.vp.partition.vocab_size]
        for tp_rank, shard in enumerate(full.chunk(tp)):
            weights[f"{name}@tp{tp_rank}"] = shard.double().tolist()
    return weights


def chunk_summary(model: list) -> list[dict]:
    from megatron.core.utils import unwrap_model

    summary = []
    for chunk in model:
        inner = unwrap_model(chunk)
        summary.append(
            {
                "pre": inner.pre_process,
                "post": inner.post_process,
                "embedding": hasattr(inner, "embedding"),
                "output_layer": hasattr(inner, "output_layer"),
                "layers": [layer.layer_number for layer in inner.decoder.layers],
                "sharded": sharded_tensors(chunk),
            }
        )
    return summary


def sharded_tensors(chunk: torch.nn.Module) -> list[list]:
    """What Megatron's checkpointing saves of a chunk: (key, global offset, global shape) of every
    sharded tensor of its ``sharded_state_dict`` (Megatron-LM's save_checkpoint starts there)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = chunk.sharded_state_dict()
    apply_factories(state)  # factories (vocabulary shards) -> the tensors they save
    return [
        [item.key, list(item.global_offset), list(item.global_shape)]
        for item in nested_values(state)
        if isinstance(item, ShardedTensor)
    ]


def megatron_save(args: argparse.Namespace, model: list) -> None:
    """Megatron-LM's ``save_checkpoint`` of the model (run with --no-save-optim --no-save-rng
    --no-ckpt-fully-parallel-save: the optimizer is shim 4's), in its ``torch_dist`` format."""
    from megatron.training import checkpointing

    from megatron_pp_ext.megatron.checkpoint import _save_strategy

    checkpointing.get_default_save_sharded_strategy = lambda *_, **__: _save_strategy()  # shim 8
    torch.cuda.get_rng_state = lambda *_, **__: torch.empty(0, dtype=torch.uint8)  # shim 8
    checkpointing.save_checkpoint(args.train_iters, model, None, None, 0)


def megatron_load(args: argparse.Namespace, model: list) -> None:
    """Megatron-LM's ``load_checkpoint`` of ``--ckpt-step`` (run with --no-load-optim
    --no-load-rng). Shim 9: its tracker reader all-reduces a CUDA tensor, so the tracker file is
    set aside while it loads (``--ckpt-step`` names the iteration instead)."""
    import os

    from megatron.training import checkpointing

    tracker = checkpointing.get_checkpoint_tracker_filename(args.load)
    aside = tracker + ".aside"
    dist.barrier()
    if dist.get_rank() == 0 and os.path.exists(tracker):
        os.rename(tracker, aside)
    dist.barrier()
    try:
        checkpointing.load_checkpoint(model, None, None, strict=True)
    finally:
        dist.barrier()
        if dist.get_rank() == 0 and os.path.exists(aside):
            os.rename(aside, tracker)


def initialize(argv: list[str]) -> None:
    from megatron.core import parallel_state

    sizes = argparse.ArgumentParser()
    sizes.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    sizes.add_argument("--tensor-model-parallel-size", type=int, default=1)
    sizes.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    sizes.add_argument("--context-parallel-size", type=int, default=1)
    sizes.add_argument("--expert-model-parallel-size", type=int, default=1)
    sizes.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    known, _ = sizes.parse_known_args(argv)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(  # shim 1
        known.tensor_model_parallel_size,
        known.pipeline_model_parallel_size,
        known.num_virtual_stages_per_pipeline_rank,
        context_parallel_size=known.context_parallel_size,
        expert_model_parallel_size=known.expert_model_parallel_size,
        expert_tensor_parallel_size=known.expert_tensor_parallel_size,
    )


def main() -> None:
    mode, out_path, _, *argv = sys.argv[1:]
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self  # shim 2
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron_pp_ext.megatron import cpu_shim

    cpu_shim.install()
    # Megatron-LM's args turn on its torch.compile'd fusions (bias-dropout-add, bias-SwiGLU):
    # inductor C++ kernels vectorized for the ISA ATEN_CPU_CAPABILITY selects. Its FX graph cache
    # key leaves that ISA out, so a graph cached under AVX-512 (16-float vectors) is reused under
    # avx2 and built with 8-float vectors: half of each output is never written (NaN loss). Key
    # the compile caches on the ISA.
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    torch.compiler.config.cache_key_tag += f"|vec_isa={pick_vec_isa()}"
    initialize(argv)
    sys.argv = ["pretrain_gpt.py", *argv]
    import megatron.legacy.fused_kernels as fused_kernels
    import pretrain_gpt
    from megatron.core import pipeline_parallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import (
        build_pretraining_data_loader,
        build_train_valid_test_datasets,
        get_model,
        train_step,
    )

    from megatron_pp_ext.megatron import pretrain as pp_ext
    from megatron_pp_ext.megatron.ddp import wrap_chunks

    fused_kernels.load = lambda args: None  # shim 3
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 10  # shim 7
    import megatron.core.datasets.helpers_cpp  # noqa: F401  (shim 6: fails here if not copied)
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None  # shim 6
    initialize_megatron(
        extra_args_provider=pp_ext.extra_args_provider(),
        allow_no_cuda=True,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )
    args = get_args()
    provider = pp_ext.placed_model_provider(partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder))
    model = get_model(provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    result: dict = {"chunks": chunk_summary(model)}
    vocab = pp_ext.setup(args).vocab  # --pp-vocab-parallel: set while get_model built the chunks
    if mode == "load":  # Megatron-LM's own load_checkpoint (args.load, --ckpt-step), no training
        model = wrap_chunks(model, DistributedDataParallelConfig())  # shim 2
        megatron_load(args, model)
        result["weights"] = {
            name: param.detach().double().tolist() for name, param in named_global_params(model).items()
        }
    if mode in ("train", "save"):
        init_by_name(model)
        if vocab is not None:
            init_vocab_by_name(vocab)
        model = wrap_chunks(model, DistributedDataParallelConfig())  # shim 2
        config = get_model_config(model[0])
        optimizer = CpuOptimizer(model, args.lr)  # shim 4
        args.iteration = args.consumed_train_samples = args.consumed_valid_samples = 0  # no checkpoint
        iterators = []
        for vp_stage in range(len(model)):
            dataset_provider = partial(pretrain_gpt.train_valid_test_datasets_provider, vp_stage=vp_stage)
            dataset_provider.is_distributed = True
            train_ds = build_train_valid_test_datasets(dataset_provider)[0]  # shim 5
            loader = build_pretraining_data_loader(train_ds, 0) if train_ds else None
            iterators.append(RerunDataIterator(iter(loader)) if loader else None)
        losses = []
        for iteration in range(args.train_iters):
            loss, *_ = train_step(
                pretrain_gpt.forward_step,
                iterators if len(iterators) > 1 else iterators[0],
                model,
                optimizer,
                ConstantLR(),
                config,
                pipeline_parallel.get_forward_backward_func(),  # the hook's, once installed
                iteration,
            )
            losses.append({key: float(value) for key, value in loss.items()})
        result["losses"] = losses
        if mode == "save":  # then Megatron-LM's own save_checkpoint (args.save)
            megatron_save(args, model)
        result["weights"] = {
            name: param.detach().double().tolist()
            for name, param in named_global_params(model).items()
            if not name.startswith("vocab_parallel.")
        }
        if vocab is not None:
            result["weights"].update(vocab_weights(vocab))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as file:
            json.dump(gathered, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
