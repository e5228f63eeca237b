"""Each risky primitive once, in about 30 s, before anything heavier runs: ``preflight.py [--cpu]``.

A booking on the first GPU is short, and every later step stands on a few primitives no CPU test
runs on CUDA. Each is tried once here, in the order a failure would cost most, and printed as one
``PASS NAME: ...`` or ``FAIL NAME: ...`` line:

- ``gloo-all-reduce``: two processes on the one GPU (as ``train --distributed-backend gloo`` runs
  them) each copy a CUDA tensor to pinned host memory, all-reduce it over gloo and copy it back:
  ``dist.all_reduce`` in float32 and bf16, then two bf16 tensors inside torch.distributed's
  ``_coalescing_manager``, the call megatron-core's DDP makes for its gradient buckets (gloo's
  ``allreduce_coalesced`` takes CPU tensors only, hence the staging);
- ``gloo-isend-irecv``: rank 0 sends a host-staged CUDA tensor to rank 1 with isend/irecv, rank 1
  copies it to its GPU and sends twice it back (float32 and bf16);
- ``bf16-matmul``: a 1024^3 bf16 matmul on the GPU against float32;
- ``sdpa-flash``: causal scaled_dot_product_attention in bf16 forward and backward restricted to
  the flash kernel (what ``torch_flash`` and the local spec's SDPA run), against float32 math;
- ``cuda-events``: timing events around a kernel (``elapsed_time``, ``query``, ``synchronize``);
- ``cuda-stream``: a kernel on a side ``torch.cuda.Stream`` ordered by ``wait_stream`` and
  ``record_stream``, against the same kernel on the current stream;
- ``pinned-copy``: host-to-device and device-to-host copies with ``non_blocking=True`` through
  pinned buffers on a side stream, ordered by an event (what activation offload does).

The step ends ``PASS: ...`` when all pass, ``FAIL: ...`` naming the failures, and SKIPs when torch
does not import or there is no CUDA device. ``--cpu`` (for tests on a machine without a GPU) runs
the checks that have a CPU form on CPU tensors (gloo, matmul, SDPA) and leaves out the others.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import common

WORLD = 2
RANKS_TIMEOUT_S = 25  # starting both processes (torch's import) and their checks (the step has 30 s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the two gloo ranks (spawned processes) --------------------------------------------------------


def staged(tensor, torch):
    """``tensor`` on the host: a pinned copy of a CUDA tensor (non-blocking, then synchronised:
    gloo reads the buffer at once), the tensor itself on CPU."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return host


def gloo_all_reduce(rank: int, device, torch, dist) -> str:
    for dtype in (torch.float32, torch.bfloat16):
        value = torch.full((4096,), float(rank + 1), device=device, dtype=dtype)
        host = staged(value, torch)
        dist.all_reduce(host)
        value.copy_(host)
        if not torch.all(value == 3):
            raise AssertionError(f"{dtype} all-reduce of 1 and 2 gave {value[:4].tolist()}")
    buckets = [torch.full((n,), float(rank + 1), device=device, dtype=torch.bfloat16) for n in (1000, 3000)]
    hosts = [staged(bucket, torch) for bucket in buckets]
    with dist._coalescing_manager(async_ops=True) as manager:
        for host in hosts:
            dist.all_reduce(host, async_op=True)
    manager.wait()
    for bucket, host in zip(buckets, hosts):
        bucket.copy_(host)
        if not torch.all(bucket == 3):
            raise AssertionError(f"coalesced bf16 all-reduce of 1 and 2 gave {bucket[:4].tolist()}")
    return "float32 and bf16 all_reduce and a coalesced bf16 pair, staged through pinned host memory"


def gloo_isend_irecv(rank: int, device, torch, dist) -> str:
    for dtype in (torch.float32, torch.bfloat16):
        sent = torch.arange(2048, device=device).to(dtype)
        if rank == 0:
            dist.isend(staged(sent, torch), dst=1).wait()
            back = torch.empty(sent.shape, dtype=dtype)
            dist.irecv(back, src=1).wait()
            if not torch.equal(back.to(device), sent * 2):
                raise AssertionError(f"{dtype}: rank 1 sent back {back[:4].tolist()}, not twice what it got")
        else:
            got = torch.empty(sent.shape, dtype=dtype)
            dist.irecv(got, src=0).wait()
            on_device = got.to(device)
            if not torch.equal(on_device, sent):
                raise AssertionError(f"{dtype}: rank 1 received {got[:4].tolist()}")
            dist.isend(staged(on_device * 2, torch), dst=0).wait()
    return "rank 0 -> 1 -> 0, float32 and bf16, staged through pinned host memory"


def rank_main(rank: int, port: int, use_cuda: bool, timeout: float, results) -> None:
    """One gloo rank: each check's (name, error or None, detail) onto ``results``."""
    try:
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=timeout))
    except Exception as error:
        results.put((rank, "gloo-init", f"{type(error).__name__}: {error}", ""))
        return
    for name, check in (("gloo-all-reduce", gloo_all_reduce), ("gloo-isend-irecv", gloo_isend_irecv)):
        try:
            results.put((rank, name, None, check(rank, device, torch, dist)))
        except Exception as error:
            results.put((rank, name, f"{type(error).__name__}: {str(error)[:200]}", ""))
    dist.destroy_process_group()


def start_ranks(use_cuda: bool, timeout: float) -> tuple[list, object, float]:
    """The two gloo ranks, started (they run while this process runs its own checks)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # the ranks start CUDA themselves
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=rank_main, args=(rank, port, use_cuda, timeout * 0.6, results))
        for rank in range(WORLD)
    ]
    for process in ranks:
        process.start()
    return ranks, results, time.monotonic() + timeout


def gloo_results(ranks: list, results, deadline: float) -> list[tuple[str, str | None, str]]:
    """Both ranks' results per check (name, error or None, detail), in a check's order."""
    found: dict[str, dict[int, str | None]] = {}
    details: dict[str, str] = {}
    expected = WORLD * 2
    received = 0
    while received < expected and time.monotonic() < deadline:
        try:
            rank, name, error, detail = results.get(timeout=0.5)
        except queue.Empty:
            if not any(process.is_alive() for process in ranks) and results.empty():
                break
            continue
        received += 2 if name == "gloo-init" else 1  # a rank that did not start reports nothing more
        found.setdefault(name, {})[rank] = error
        details[name] = detail or details.get(name, "")
    for process in ranks:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    init_errors = found.pop("gloo-init", {})
    if init_errors:  # the checks did not run
        return [("gloo-init", "; ".join(f"rank {r}: {e}" for r, e in sorted(init_errors.items())), "")]
    checks = []
    for name in ("gloo-all-reduce", "gloo-isend-irecv"):
        per_rank = found.get(name, {})
        errors = [f"rank {rank}: {error}" for rank, error in sorted(per_rank.items()) if error]
        missing = [rank for rank in range(WORLD) if rank not in per_rank]
        if missing:
            codes = ", ".join(f"rank {rank} exit code {ranks[rank].exitcode}" for rank in missing)
            errors.append(f"no result by the deadline ({codes})")
        checks.append((name, "; ".join(errors) or None, details.get(name, "")))
    return checks


# ---- one process -------------------------------------------------------------------------------


def bf16_matmul(device, torch) -> str:
    torch.manual_seed(0)
    a, b = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    error = common.rel_error((a.bfloat16() @ b.bfloat16()).float(), a @ b)
    if not error < 1e-2:
        raise AssertionError(f"relative error {error:.2e} against float32 (expected below 1e-2)")
    return f"1024^3, relative error {error:.1e} against float32"


def sdpa_flash(device, torch) -> str:
    import torch.nn.functional as functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = (2, 8, 512, 64)  # batch, heads, sequence, head dim
    leaves = [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    kernel = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    with sdpa_kernel([kernel]):
        out = functional.scaled_dot_product_attention(*leaves, is_causal=True)
    out.float().square().sum().backward()
    reference = [leaf.detach().float().requires_grad_() for leaf in leaves]
    with sdpa_kernel([SDPBackend.MATH]):
        expected = functional.scaled_dot_product_attention(*reference, is_causal=True)
    expected.square().sum().backward()
    errors = [common.rel_error(out.detach().float(), expected.detach())]
    errors += [common.rel_error(leaf.grad.float(), ref.grad) for leaf, ref in zip(leaves, reference)]
    if not max(errors) < 3e-2:
        raise AssertionError(f"relative errors (out, dq, dk, dv) {[f'{e:.1e}' for e in errors]} above 3e-2")
    name = "flash" if kernel == SDPBackend.FLASH_ATTENTION else "math (CPU)"
    return f"{name} kernel, causal bf16 {list(shape)}, forward and backward within {max(errors):.1e} of fp32"


def cuda_events(device, torch) -> str:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    start.record()
    for _ in range(4):
        a = a @ a / 2048**0.5
    end.record()
    end.synchronize()
    if not end.query():
        raise AssertionError("the end event is not complete after synchronize()")
    elapsed = start.elapsed_time(end)
    if not elapsed > 0:
        raise AssertionError(f"elapsed_time {elapsed} ms")
    return f"4 bf16 2048^3 matmuls timed at {elapsed:.3f} ms"


def cuda_stream(device, torch) -> str:
    torch.manual_seed(0)
    x = torch.randn(1024, 1024, device=device)
    expected = x @ x
    side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)  # x is ready
    with torch.cuda.stream(side):
        y = x @ x
    current.wait_stream(side)
    y.record_stream(current)
    if not torch.allclose(y, expected, rtol=1e-5, atol=1e-5):
        raise AssertionError("the side stream's matmul differs from the current stream's")
    return "matmul on a side stream (wait_stream, record_stream) equals the current stream's"


def pinned_copy(device, torch) -> str:
    host = torch.randn(1 << 20).pin_memory()
    if not host.is_pinned():
        raise AssertionError("pin_memory() gave an unpinned tensor")
    back = torch.empty(host.shape, pin_memory=True)
    copies = torch.cuda.Stream(device)
    done = torch.cuda.Event()
    with torch.cuda.stream(copies):
        on_device = host.to(device, non_blocking=True)
        doubled = on_device * 2
        back.copy_(doubled, non_blocking=True)
        done.record()
    done.synchronize()
    if not torch.equal(back, host * 2):
        raise AssertionError("the round trip through pinned memory changed the values")
    return (
        f"{host.numel() * 4 / 2**20:.0f} MiB host -> device -> host, non_blocking on a side stream, an event"
    )


def run(name: str, check: Callable[..., str], *args) -> tuple[str, str | None, str]:
    try:
        return name, None, check(*args)
    except Exception as error:
        frames = traceback.extract_tb(error.__traceback__)
        where = f" (line {frames[-1].lineno})" if frames else ""
        return name, f"{type(error).__name__}: {str(error)[:200]}{where}", ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the checks with a CPU form, on CPU tensors")
    parser.add_argument(
        "--timeout",
        type=float,
        default=RANKS_TIMEOUT_S,
        help="seconds for the gloo ranks to start and finish",
    )
    args = parser.parse_args()
    started = time.monotonic()
    try:
        import torch
    except ImportError as error:
        common.skip(f"torch does not import ({error})")
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = common.need_cuda()
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    ranks = start_ranks(device.type == "cuda", args.timeout)
    checks = {"bf16-matmul": bf16_matmul, "sdpa-flash": sdpa_flash}
    if device.type == "cuda":
        checks.update({"cuda-events": cuda_events, "cuda-stream": cuda_stream, "pinned-copy": pinned_copy})
    own = [run(name, check, device, torch) for name, check in checks.items()]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    results = gloo_results(*ranks) + own
    for name, error, detail in results:
        print(f"FAIL {name}: {error}" if error else f"PASS {name}: {detail}", flush=True)
    failed = [name for name, error, _ in results if error]
    took = f"{time.monotonic() - started:.0f} s"
    if failed:
        common.fail(f"{len(failed)} of {len(results)} primitives failed: {', '.join(failed)} ({took})")
    common.passed(f"{len(results)} primitives: {', '.join(name for name, _, _ in results)} ({took})")


if __name__ == "__main__":
    main()
