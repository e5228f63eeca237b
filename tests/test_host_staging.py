"""Ranks sharing a GPU talk gloo, which moves host memory only (``--distributed-backend gloo``):
pipeline messages are staged through host memory. On CPU the staging is the identity; a receive
for a device gloo cannot reach (the meta device stands in for CUDA here) lands in host memory and
is moved to the asked device when it is waited for."""

from __future__ import annotations

import torch
from dist_utils import run_ranks


def staging_worker(rank: int, world: int) -> dict:
    from megatron_pp_ext.runtime.p2p import PipeComm

    comm = PipeComm(timeout_s=30)
    result: dict = {"wire": str(comm.wire_device(torch.device("meta")))}
    if rank == 0:
        comm.send(torch.arange(6, dtype=torch.float32).reshape(2, 3), 1, "F", "SEND_F0")
        comm.flush()
    else:
        posted = comm.post_recv((2, 3), torch.float32, torch.device("meta"), 0, "F", "RECV_F0")
        result["buffer_device"] = str(posted.buffer.device)  # in flight: host memory
        arrived = posted.wait()
        result["arrived_device"] = str(arrived.device)
        result["shape"] = list(arrived.shape)
        cpu = comm.post_recv((2,), torch.float32, torch.device("cpu"), 0, "F", "RECV_F1")
        result["cpu_is_buffer"] = cpu.buffer is not None
    if rank == 0:
        comm.send(torch.tensor([7.0, 8.0]), 1, "F", "SEND_F1")
        comm.flush()
    else:
        result["cpu_values"] = cpu.wait().tolist()
    comm.close()
    return result


def test_messages_for_an_unreachable_device_are_staged_through_host_memory() -> None:
    sender, receiver = run_ranks(staging_worker, 2, timeout=120)
    assert sender["wire"] == receiver["wire"] == "cpu"
    assert receiver["buffer_device"] == "cpu" and receiver["arrived_device"] == "meta"
    assert receiver["shape"] == [2, 3]
    assert receiver["cpu_values"] == [7.0, 8.0]  # a CPU receive is its buffer, unchanged
