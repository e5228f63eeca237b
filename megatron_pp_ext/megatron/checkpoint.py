"""Checkpoints any schedule, placement or parallel layout can load (megatron-core's
``dist_checkpointing``).

A checkpoint holds global tensors, not ranks' pieces: every parameter is a sharded tensor keyed
by its name in the whole model, Megatron's way (``decoder.layers.<name>`` stacked over the
model's layers, ``embedding.*``, ``decoder.final_layernorm.*``, ``output_layer.*``, tensor-
parallel shards placed by Megatron's own sharding), and Adam's moments are keyed by the same
names (``optimizer.state.exp_avg.<key>``). Our chunks are self-contained GPTModels numbering
their layers from 1, so :func:`chunk_sharded_state_dict` gives each layer its global index from
the stage's offset (V-shape: stage 2p-1-r on rank r holds the layers of that stage, wherever it
sits). Vocabulary-parallel shards are rows of the same embedding and output tables
(``VocabParallel.sharded_state_dict``). Saved under v-zb with PP=2, the checkpoint loads under 1F1B,
interleaved 1F1B, PP=1 with TP=2 or DP=2, with or without vocabulary parallelism:
``dist_checkpointing`` reads each rank's slices of the global tensors.

Directory layout as Megatron-LM's: ``DIR/iter_0000100/`` (a ``torch_dist`` checkpoint) and
``DIR/latest_checkpointed_iteration.txt``. A save is atomic: it writes ``iter_XXXXXXX.tmp``,
renames it when every rank is done and replaces the tracker file last (write, fsync, rename),
so a crash or a full disk during a save leaves the previous checkpoint the one loaded.

Besides model and optimizer: the iteration, consumed samples, skipped iterations, the learning-
rate schedule's settings and the layout that wrote it (common state), and each rank's RNG states
(restored only under the same layout; the models here have no dropout, so they change nothing).
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded here; the message says which and why."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    """Megatron-LM's directory of one checkpoint."""
    return Path(root) / f"iter_{iteration:07d}"


def read_tracker(root: str | Path) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None without one."""
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number") from None


def _fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: a rename) to disk; some filesystems refuse a
    directory's fsync, which then has to do without."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def write_tracker(root: str | Path, iteration: int) -> None:
    """Replace the tracker atomically: a reader sees the old iteration or the new one."""
    root = Path(root)
    staging = root / f"{TRACKER}.tmp"
    with open(staging, "w") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, root / TRACKER)
    _fsync(root)


# ---- the model's sharded state dict with global layer numbers --------------------------------


def chunk_sharded_state_dict(
    chunk: torch.nn.Module, layer_offset: int, num_layers: int, metadata: dict | None = None
) -> dict[str, Any]:
    """A chunk's sharded state dict with global layer indices: its i-th layer is layer
    ``layer_offset + i`` of ``num_layers``. The local keys stay the chunk's own (what its
    ``load_state_dict`` takes); the sharded keys are the whole model's."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import sharded_state_dict_default
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(chunk)
    state: dict[str, Any] = {}
    for prefix, module, group in _modules_but_layers(gpt):  # as GPTModel's sharded_state_dict
        state.update(sharded_state_dict_default(module, prefix, (), metadata, tp_group=group))
    state.pop("output_layer._extra_state", None)  # GPTModel drops it too (always empty)
    # The layers, stacked on a leading axis of the whole model's layers (Megatron's layout).
    for index, layer in enumerate(gpt.decoder.layers):
        local = f"decoder.layers.{index}."
        layer_state = layer.sharded_state_dict(local, ((0, layer_offset + index, num_layers),), metadata)
        replace_prefix_for_sharding(layer_state, local, "decoder.layers.")
        state.update(layer_state)
    return state


def _modules_but_layers(gpt: torch.nn.Module) -> Any:
    """(prefix, module, tensor-parallel group) of every child of the GPTModel and of its
    decoder but the decoder's layers."""
    for name, child in gpt.named_children():
        if name != "decoder":
            yield f"{name}.", child, getattr(gpt, "tp_group", None)
            continue
        for sub, module in child.named_children():
            if sub != "layers":
                yield f"decoder.{sub}.", module, getattr(child, "tp_group", None)


def model_sharded_state_dict(
    model: Sequence[torch.nn.Module], stages: Sequence[int], layers_per_stage: Sequence[int]
) -> dict[str, dict[str, Any]]:
    """``{"chunk<i>": ...}`` for this rank's chunks, chunk i being virtual stage ``stages[i]``."""
    offsets = [sum(layers_per_stage[:stage]) for stage in range(len(layers_per_stage))]
    total = sum(layers_per_stage)
    return {
        f"chunk{index}": chunk_sharded_state_dict(chunk, offsets[stage], total)
        for index, (chunk, stage) in enumerate(zip(model, stages))
    }


@torch.no_grad()
def load_model_state(model: Sequence[torch.nn.Module], loaded: dict[str, dict[str, Any]]) -> None:
    """Copy a loaded :func:`model_sharded_state_dict` into the chunks (every parameter and
    persistent buffer must be there; ``_extra_state`` may not be)."""
    from megatron.core.utils import unwrap_model

    for index, chunk in enumerate(model):
        gpt = unwrap_model(chunk)
        result = gpt.load_state_dict(loaded[f"chunk{index}"], strict=False)
        missing = [key for key in result.missing_keys if not key.endswith("_extra_state")]
        unexpected = [key for key in result.unexpected_keys if not key.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(f"chunk {index}: missing {missing[:5]}, unexpected {unexpected[:5]}")


# ---- RNG --------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's random states (Python, torch, CUDA and Megatron's CUDA tracker on GPU)."""
    state: dict[str, Any] = {"random": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object() -> Any:
    """Each rank's RNG states as one shard of a global object (restorable on the same layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", rng_state(), (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


# ---- save and load ----------------------------------------------------------------------------


def _save_strategy() -> Any:
    """Megatron's ``torch_dist`` format, written in this process by torch's own DCP writer.

    megatron-core's writer for it (``FileSystemWriterAsync``) forks writer processes, starts a
    multiprocessing manager and calls ``torch.cuda.synchronize()``, which a CPU-only torch
    refuses and a daemonic worker may not do. The files are the same DCP checkpoint, read back
    by Megatron's own ``torch_dist`` load strategy (``metadata.json`` names it)."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp_save(
                mcore_to_pyt_state_dict(state, False),
                storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1, sync_files=True),
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
                ),
            )

    return InProcessTorchDistSave("torch_dist", 1)


def save_checkpoint(root: str | Path, iteration: int, state: dict[str, Any]) -> Path:
    """Save ``state`` (a sharded state dict) as ``root/iter_XXXXXXX``, atomically (see the
    module docstring). Collective: every rank calls it. Returns the checkpoint's directory."""
    root = Path(root)
    final = iteration_dir(root, iteration)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # what an interrupted save left
        staging.mkdir()
    dist.barrier()
    # ends in a barrier: every rank's files are written
    dist_checkpointing.save(state, str(staging), sharded_strategy=_save_strategy())
    if rank == 0:
        for path in staging.rglob("*"):
            if path.is_file():
                _fsync(path)
        _fsync(staging)
        replaced = final.with_name(final.name + ".old")  # found by find_checkpoint meanwhile
        if final.exists():  # the same iteration saved again (a resumed run)
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
        os.rename(staging, final)
        _fsync(root)
        write_tracker(root, iteration)
        shutil.rmtree(replaced, ignore_errors=True)
    dist.barrier()
    return final


def find_checkpoint(root: str | Path, iteration: int | None = None) -> Path | None:
    """The checkpoint ``--load root`` means: ``iteration`` if given (Megatron's ``--ckpt-step``),
    else the tracker's; None when ``root`` has no tracker (a fresh start, as Megatron-LM)."""
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    path = iteration_dir(root, iteration)
    for candidate in (path, path.with_name(path.name + ".old")):  # .old: a re-save cut short
        if (candidate / "metadata.json").is_file():
            return candidate
    raise CheckpointError(f"{path} is not a complete checkpoint (no metadata.json)")


def read_common(path: str | Path) -> dict[str, Any]:
    """The common (non-sharded) part: iteration, data position, layout that wrote it."""
    return dist_checkpointing.load_common_state_dict(str(path))


@dataclass
class TrainingCheckpoint:
    """What ``train`` saves and loads: model chunks (chunk i is virtual stage ``stages[i]``, the
    model split as ``layers_per_stage``), the optimizer, RNG, and a common dict (iteration, data
    position, ...). ``layout`` describes what writes it; RNG states are restored only when the
    checkpoint's ``layout["parallel"]`` (the parallel sizes) is this one's."""

    model: Sequence[torch.nn.Module]
    optimizer: Any
    stages: Sequence[int]
    layers_per_stage: Sequence[int]
    layout: dict[str, Any] = field(default_factory=dict)

    def sharded_state_dict(
        self, common: dict[str, Any], optimizer: bool = True, rng: bool = True, loading: bool = False
    ) -> dict:
        model = model_sharded_state_dict(self.model, self.stages, self.layers_per_stage)
        state: dict[str, Any] = {
            "model": model,
            "checkpoint_version": CHECKPOINT_VERSION,
            "layout": dict(self.layout),
            **common,
        }
        if optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(model, is_loading=loading)
        if rng:
            state["rng_state"] = _rng_object()
        return state

    def save(self, root: str | Path, iteration: int, common: dict[str, Any]) -> Path:
        return save_checkpoint(root, iteration, self.sharded_state_dict({"iteration": iteration, **common}))

    def load(self, path: str | Path, load_optimizer: bool = True, load_rng: bool = True) -> dict[str, Any]:
        """Load ``path`` into model, optimizer and RNG; return its common state, with
        ``rng_restored`` saying whether the RNG states were (same layout only)."""
        common = read_common(path)
        saved = common.get("layout", {}).get("parallel")
        rng = load_rng and saved is not None and saved == self.layout.get("parallel")
        state = self.sharded_state_dict({}, optimizer=load_optimizer, rng=rng, loading=True)
        with warnings.catch_warnings():  # torch's DCP deprecations, once per rank and load
            warnings.simplefilter("ignore", FutureWarning)
            loaded = dist_checkpointing.load(state, str(path))
        load_model_state(self.model, loaded["model"])
        if load_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
        if rng:
            set_rng_state(loaded["rng_state"])
        return {**common, "rng_restored": rng}
