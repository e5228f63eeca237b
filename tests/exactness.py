"""The suite's one rule for "the same numbers": how far a pipelined value may be from the reference.

A pipeline computes the same sums as the model run without a pipeline, in another order: other
microbatch, slice and rank boundaries, and other CPU kernels (AVX2 or AVX-512, one thread or
several) that split a matmul's reduction differently. Summing n terms in a precision with machine
epsilon u can change the result by up to about n * u of the sum of the terms' magnitudes (Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2), and each optimizer step
starts the next from weights that already differ. So a comparison's tolerance is

    tolerance = eps(dtype) * terms * steps

where ``terms`` is the length of the longest sum behind one compared value (:func:`step_terms`
for a training step) and ``steps`` the optimizer steps it went through. Every error is relative
to the reference tensor's norm (``runtime_case.rel_error``), never element by element: a gradient
element near zero has no relative precision to keep. In float64 the same rule gives 1e-15 to 1e-13
for these tiny models, and :func:`tolerance` refuses to return more than 1e-12 there, so the
float64 twin of a case stays strict enough to catch any real error; a real pipeline error (a
missing slice, a message from the wrong microbatch) is of the order of the values themselves.

Set ``PP_EXT_ERROR_LOG=FILE`` to append every checked error with its tolerance (JSON lines, with
the test's id); ``python scripts/exactness_margins.py FILE`` prints the tightest margins.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

FLOAT64_CEILING = 1e-12  # never looser than this in float64, whatever the sums' length

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    return _DTYPES[dtype] if isinstance(dtype, str) else dtype


# Roundings a layer adds besides its sums: norm, rotary, activation, and the softmax, whose exp
# of a score difference (and the merge of slices' partial results) multiplies the score's rounding
# by its magnitude; 64 covers the worst seen (sliced attention in float64: 16 ulps, margin 4.5).
ELEMENTWISE_ROUNDINGS = 64


def step_terms(tokens: int, num_layers: int, width: int) -> int:
    """The longest chain of roundings behind a gradient after one step: a weight gradient sums
    over every token of the step, and each token's factor went through ``num_layers`` layers, each
    contracting over at most ``width`` values (hidden, FFN or sequence length) and rounding its
    elementwise functions."""
    return tokens + num_layers * (width + ELEMENTWISE_ROUNDINGS)


def tolerance(dtype: str | torch.dtype, terms: int, steps: int = 1) -> float:
    """eps(dtype) * terms * steps, at most 1e-12 in float64 (see the module docstring)."""
    dtype = _dtype(dtype)
    if terms < 1 or steps < 1:
        raise ValueError(f"terms and steps must be positive, got {terms} and {steps}")
    value = torch.finfo(dtype).eps * terms * steps
    if dtype == torch.float64:
        return min(value, FLOAT64_CEILING)
    return value


def training_tolerance(
    model: Any, microbatches: int, steps: int, micro_batch: int = 2, data_parallel: int = 1
) -> float:
    """:func:`tolerance` for a run of ``steps`` training steps of ``model`` (a ``ModelConfig``:
    layers, widths, sequence length, dtype) over ``microbatches`` microbatches of ``micro_batch``
    sequences on each of ``data_parallel`` ranks."""
    tokens = microbatches * micro_batch * model.seq_length * data_parallel
    width = max(model.hidden_size, model.ffn_hidden_size, model.seq_length)
    return tolerance(model.dtype, step_terms(tokens, model.num_layers, width), steps)


def train_tolerance(
    steps: int, global_batch: int, num_layers: int | None = None, seq_length: int | None = None
) -> float:
    """:func:`training_tolerance` for ``steps`` iterations of ``megatron-pp-ext train`` on the
    default model (configs/tiny-llama.yaml, float32, with the given ``--num-layers`` and
    ``--seq-length``) at ``global_batch`` sequences a step."""
    from types import SimpleNamespace

    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "configs/tiny-llama.yaml").read_text())["model"]
    if num_layers is not None:
        config["num_layers"] = num_layers
    if seq_length is not None:
        config["seq_length"] = seq_length
    return training_tolerance(SimpleNamespace(**config), global_batch, steps, micro_batch=1)


def check(error: float, limit: float, what: str) -> None:
    """Assert ``error < limit`` (a relative error and its tolerance), recording both when
    ``PP_EXT_ERROR_LOG`` names a file."""
    log = os.environ.get("PP_EXT_ERROR_LOG")
    if log:
        row = {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
            "what": what,
            "error": float(error),
            "tolerance": float(limit),
        }
        with open(log, "a") as handle:
            handle.write(json.dumps(row) + "\n")
    assert error < limit, f"{what}: off by {error:.3g} (relative; tolerance {limit:.3g})"


def check_worst(errors: dict[str, float], limit: float, what: str) -> None:
    """:func:`check` on the largest of ``errors`` (name -> relative error), naming it."""
    name, error = max(errors.items(), key=lambda item: item[1])
    check(error, limit, f"{what} {name}")
