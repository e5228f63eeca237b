"""The test harness's launcher: a launch whose store port was taken between picking it and rank 0's
listen (the other test worker picking the same free port) is started again on a fresh port, not
reported as the test's failure (a flake seen in the quick tier: EADDRINUSE on the TCPStore)."""

from __future__ import annotations

import socket

import dist_utils
from dist_utils import check_ok, run_ranks


def _world_size(rank: int, world: int) -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_a_launch_whose_port_was_taken_starts_again(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = dist_utils.free_port

        def first_taken() -> int:
            ports.append(real())
            return ports[0] if len(ports) == 2 else ports[-1]

        monkeypatch.setattr(dist_utils, "free_port", first_taken)
        assert check_ok(run_ranks(_world_size, 2, timeout=60)) == [2, 2]
    assert len(ports) == 3, ports  # the taken port, then a fresh one
