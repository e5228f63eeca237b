"""What started this process, read from the environment without importing torch: a command
checks its flags against the launcher's world before it imports anything heavy."""

from __future__ import annotations

import os


def launcher_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) given by torchrun or SLURM, or None if neither ran us."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise RuntimeError(f"under srun, set {name} (e.g. the first host of $SLURM_NODELIST)")
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None
