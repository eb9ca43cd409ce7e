"""``--tp N`` on the command line: one process per GPU under torchrun, the process group, the sharded model.

A command given ``--tp N`` outside torchrun starts itself again under ``python -m torch.distributed.run
--standalone --nproc-per-node N`` (:func:`relaunch`) and returns its exit code; each process then joins the
group (:func:`init_tp`: NCCL on CUDA, one GPU per local rank; gloo on CPU), shards the model with
:func:`~piecegraph.parallel.apply_tp` and runs the same program, so that every collective pairs up. Rank 0
alone prints and writes files (:attr:`TPRun.reports`); every rank ends with :meth:`TPRun.finish`. NCCL's
NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` unless the caller set it): torchrun hands its environment
to the ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from piecegraph.parallel.ops import register_group

GROUP = "tp"  # the name the command line registers its group under


@dataclass(frozen=True)
class TPRun:
    """This process's place in a ``--tp`` run: its rank, the world size and the collective backend (``None``
    for a single process, :data:`SINGLE`)."""

    rank: int
    world: int
    backend: str | None

    @property
    def solo(self) -> bool:
        """A single process: no group, nothing sharded."""
        return self.world == 1

    @property
    def reports(self) -> bool:
        """Whether this rank prints and writes results (rank 0)."""
        return self.rank == 0

    def facts(self) -> dict[str, int | str | None]:
        """What a results JSON records of the run."""
        return {"world_size": self.world, "tp_backend": self.backend}

    def finish(self) -> None:
        """Wait for every rank, then leave the group (every rank, at the end of a command); nothing when solo."""
        if not self.solo and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


SINGLE = TPRun(rank=0, world=1, backend=None)


def needs_relaunch(world: int) -> bool:
    """Whether ``--tp world`` must start torchrun first (``world > 1`` and this process is not one of its ranks).

    Raises ``ValueError`` when torchrun started a different number of processes than ``--tp`` asks for."""
    if world <= 1:
        return False
    launched = os.environ.get("WORLD_SIZE")
    if launched is None:
        return True
    if int(launched) != world:
        raise ValueError(f"--tp {world} but torchrun started {launched} processes (WORLD_SIZE); pass "
                         f"--nproc-per-node {world}, or drop torchrun and let piecegraph start the ranks")
    return False


def relaunch(world: int, argv: Sequence[str]) -> int:
    """Run ``python -m piecegraph.cli *argv`` as ``world`` ranks under torchrun; returns its exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "piecegraph.cli", *argv]
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return subprocess.call(command, env=env)


def init_tp(world: int, device: str) -> TPRun:
    """Join the torchrun group (NCCL on ``device="cuda"``, gloo otherwise) and register it as :data:`GROUP`.

    On CUDA each rank takes GPU ``LOCAL_RANK`` and runs one all-reduce at once: NCCL builds its communicator at
    the first collective, which must not be inside a CUDA graph capture.
    """
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ValueError(f"--tp {world}: rank {local} has no GPU ({torch.cuda.device_count()} visible); "
                             "use at most one rank per GPU")
        torch.cuda.set_device(local)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend)
    register_group(GROUP)
    dist.all_reduce(torch.zeros(1, device=torch.device(device)))
    return TPRun(dist.get_rank(), dist.get_world_size(), backend)
