"""A stand-in for a megatron-core model chunk that records what a schedule does to it.

Megatron's forward-backward contract, seen from a model: ``set_input_tensor`` gets a list,
``set_is_first_microbatch`` comes before a chunk's first microbatch (Transformer Engine's FP8
weight refresh), ``set_current_microbatch`` sets ``current_microbatch`` on the decoder's layers,
``config.enable_autocast`` wraps the forward, a three-argument ``forward_step_func`` gets
``checkpoint_activations_microbatch``. :class:`StandInStage` logs each of these, so the contract
tests run one case under megatron-core's schedule and under ours and compare the logs, the
losses and every gradient.

The chunks are plain torch (no megatron-core layers) and end in ``tanh``, which autograd saves
as its own output: a runtime that frees a sent output's storage under autograd's nose gives
wrong gradients here (GPT stages end in a residual add and would not show it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, VOCAB, SEQ, MICRO_BATCH = 8, 16, 8, 2


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.current_microbatch: int | None = None  # Megatron's set_current_microbatch sets it


class Decoder(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))


class StandInStage(torch.nn.Module):
    """Stage ``stage`` of ``stages``: embedding on the first, tanh layers, a head and per-token
    cross-entropy on the last. Its weights depend only on ``stage`` (seeded), so any placement
    of the stages builds the same model."""

    def __init__(self, config: Any, stage: int, stages: int, layers: int = 2) -> None:
        super().__init__()
        from megatron.core.enums import ModelType

        torch.manual_seed(1000 + stage)
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.stage = stage
        self.pre, self.post = stage == 0, stage == stages - 1
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN) if self.pre else None
        self.decoder = Decoder(layers)
        self.head = torch.nn.Linear(HIDDEN, VOCAB) if self.post else None
        self.input_tensor: torch.Tensor | None = None
        self.first_pending = False
        self.events: list[tuple] = []

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.events.append(("input-is-list", isinstance(input_tensor, list)))
        self.input_tensor = input_tensor[0]  # Megatron's contract: a list

    def set_is_first_microbatch(self) -> None:
        self.first_pending = True

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        microbatch = self.decoder.layers[0].current_microbatch
        self.events.append(("forward", microbatch, self.first_pending))
        self.events.append(("autocast", torch.is_autocast_enabled(tokens.device.type)))
        self.first_pending = False
        x = self.embedding(tokens).transpose(0, 1) if self.pre else self.input_tensor  # [s, b, h]
        for layer in self.decoder.layers:
            x = torch.tanh(layer.linear(x))  # autograd saves the output itself
        if not self.post:
            return x
        logits = self.head(x).float()
        return (
            F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1), reduction="none")
            .view(labels.shape[1], labels.shape[0])
            .t()
        )


def batches(count: int, lengths: list[int] | None = None, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        length = SEQ if lengths is None else lengths[index % len(lengths)]
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, length), generator=generator)
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, length), generator=generator)
        out.append({"tokens": tokens, "labels": labels})
    return out


def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> Any:
    if non_loss_data:
        return {"mean": output.detach().mean()}
    total = output.sum()
    tokens = torch.tensor(output.numel(), dtype=torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}


def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module) -> tuple[Any, Any]:
    batch = next(data_iterator)
    return model(batch["tokens"], batch["labels"]), loss_func


def forward_step_checkpoints(
    data_iterator: Iterator[Any],
    model: torch.nn.Module,
    checkpoint_activations_microbatch: bool | None = None,
) -> tuple[Any, Any]:
    """The three-argument form (partial activation checkpoints): logs the third argument."""
    model.events.append(("checkpoint", checkpoint_activations_microbatch))
    return forward_step(data_iterator, model)


class Timers:
    """Megatron-LM's ``Timers`` as the schedules use it: ``timers(name, log_level).start()``."""

    def __init__(self) -> None:
        self.starts: Counter[str] = Counter()
        self.stops: Counter[str] = Counter()
        self.levels: dict[str, int] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        if log_level is not None:
            self.levels[name] = log_level
        return _Timer(self, name)


class _Timer:
    def __init__(self, timers: Timers, name: str) -> None:
        self.timers, self.name = timers, name

    def start(self, barrier: bool = False) -> None:
        self.timers.starts[self.name] += 1

    def stop(self, barrier: bool = False) -> None:
        self.timers.stops[self.name] += 1


class SyncLog:
    """``no_sync_func`` / ``grad_sync_func`` of a config, counted."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def no_sync(self) -> Any:
        log = self

        class _NoSync:
            def __enter__(self) -> None:
                log.calls["no_sync enter"] += 1

            def __exit__(self, *exc: Any) -> None:
                log.calls["no_sync exit"] += 1

        return _NoSync()

    def grad_sync(self, params: Any = None) -> None:
        self.calls["grad_sync"] += 1
