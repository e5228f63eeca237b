"""What this machine has, before anything heavier runs: ``probe.py CHECK``.

CHECK is one of:

- ``versions``: Python, torch, the CUDA torch was built for, megatron-core, Transformer Engine,
  flash-attn (``--line``: the same on one line, for the docs block; never fails);
- ``imports``: which of megatron.core, transformer_engine, flash_attn and apex import. The
  runtime needs megatron.core (a failure without it); the others are optional (Megatron's local
  spec, torch's SDPA and torch's optimizers stand in), so they are only reported;
- ``cuda``: ``torch.cuda.is_available()``, the device's name, memory and compute capability;
- ``bf16``: ``torch.cuda.is_bf16_supported()`` and one bf16 matmul against float32;
- ``nccl``: ``torch.cuda.nccl.version()`` and a one-rank NCCL all-reduce (train and bench use
  NCCL on GPUs).

The CUDA checks say SKIP on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import socket
import sys
from importlib import metadata

import common

OPTIONAL = ("transformer_engine", "flash_attn", "apex")


def version_of(distribution: str, module: str) -> str:
    """The installed version, "not installed", or why the module does not import."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        pass
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError:
        return "not installed"
    except Exception as error:  # a broken install: say why
        return f"does not import ({type(error).__name__})"
    return getattr(imported, "__version__", "unknown version")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    try:
        import torch

        found["torch"] = torch.__version__
        found["CUDA"] = torch.version.cuda or "none (CPU build)"
    except ImportError:
        found["torch"] = found["CUDA"] = "not installed"
    found["megatron-core"] = version_of("megatron-core", "megatron.core")
    found["TE"] = version_of("transformer-engine", "transformer_engine")
    found["flash-attn"] = version_of("flash-attn", "flash_attn")
    return found


def check_versions(line: bool) -> None:
    found = versions()
    if line:
        print(", ".join(f"{name} {version}" for name, version in found.items()))
        return
    for name, version in found.items():
        print(f"{name:14} {version}")
    common.passed(", ".join(f"{name} {version}" for name, version in found.items()))


def check_imports() -> None:
    results = {}
    for module in ("megatron.core", *OPTIONAL):
        try:
            importlib.import_module(module)
            results[module] = "imports"
        except Exception as error:  # report whatever stops the import
            results[module] = f"does not import ({type(error).__name__}: {str(error)[:120]})"
        print(f"{module:18} {results[module]}")
    summary = ", ".join(f"{module} {'yes' if ok == 'imports' else 'no'}" for module, ok in results.items())
    if results["megatron.core"] != "imports":
        common.fail(f"megatron.core does not import (the runtime needs it): {summary}")
    common.passed(summary)


def check_cuda() -> None:
    import torch

    print(f"torch.cuda.is_available(): {torch.cuda.is_available()}")
    print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    device = common.need_cuda()
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    print(f"devices: {torch.cuda.device_count()}")
    print(
        f"device 0: {props.name}, {common.gib(total)} total, {common.gib(free)} free, "
        f"compute capability {props.major}.{props.minor}, {props.multi_processor_count} SMs"
    )
    common.passed(f"{props.name}, {common.gib(total)}, sm_{props.major}{props.minor}")


def check_bf16() -> None:
    import torch

    device = common.need_cuda()
    supported = torch.cuda.is_bf16_supported()
    print(f"torch.cuda.is_bf16_supported(): {supported}")
    if not supported:
        common.fail("the device does not support bf16 (every GPU phase runs in bf16)")
    torch.manual_seed(0)
    a, b = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    error = common.rel_error((a.bfloat16() @ b.bfloat16()).float(), a @ b)
    print(f"bf16 matmul 1024^3, relative error against float32: {error:.2e}")
    if not error < 1e-2:
        common.fail(f"bf16 matmul relative error {error:.2e} (expected below 1e-2)")
    common.passed(f"bf16 supported, matmul relative error {error:.1e}")


def check_nccl() -> None:
    import torch
    import torch.distributed as dist

    device = common.need_cuda()
    version = torch.cuda.nccl.version()
    version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    print(f"torch.cuda.nccl.version(): {version}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    tensor = torch.ones(4, device=device)
    dist.all_reduce(tensor)
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
    print(f"one-rank NCCL all-reduce: {tensor.tolist()}")
    common.passed(f"NCCL {version}, one-rank all-reduce ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("versions", "imports", "cuda", "bf16", "nccl"))
    parser.add_argument("--line", action="store_true", help="versions: one line, for the docs block")
    args = parser.parse_args()
    if args.check == "versions":
        check_versions(args.line)
    else:
        {"imports": check_imports, "cuda": check_cuda, "bf16": check_bf16, "nccl": check_nccl}[args.check]()


if __name__ == "__main__":
    sys.exit(main())
