"""This process's tensor-parallel group: its rank, its world size, and the few collectives the layers call.

World size 1 is the plain single-process engine: `SINGLE` does no communication at all, and the layers
decide once, when they are built, whether they communicate, so a single-rank step runs as before.

For N > 1 every rank builds its own torch.distributed process group object (no default group: nothing
global, so one process may run several engines in turn, as the tests do): gloo on the CPU, NCCL on CUDA,
meeting through a file store in the engine's private runtime directory. On the CPU (x86-64) all-reduces
go through shared memory instead (engine_core/parallel/shm_allreduce.py: ~20x faster than gloo for a
decode step), gloo taking the large ones and the gathers. Every collective has a timeout: a dead peer
fails the next collective at once (its sockets close, or its liveness check fails), a hung one after
`timeout_s`, with a RuntimeError either way. After such an error the group is unusable; the engine
reports itself dead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_core.parallel.shm_allreduce import ShmAllReduce

DEFAULT_TIMEOUT_S = 300.0  # a collective waits this long for a hung peer (a dead one fails at once)


class TPGroup:
    """The tensor-parallel group of this process (world size 1: no communication)."""

    def __init__(self, rank: int = 0, world_size: int = 1, process_group=None, shm: ShmAllReduce | None = None):
        self.rank = rank
        self.world_size = world_size
        self._pg = process_group
        self._shm = shm
        # Time spent in collectives (all-reduces and gathers) and their count, while `timing` is on
        # (benchmarks/parallel.py): communication plus waiting for the slowest rank.
        self.timing = False
        self.collective_seconds = 0.0
        self.collective_calls = 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (every rank gets the same bits); returns it."""
        if self._pg is None:
            return tensor
        if not tensor.is_contiguous():
            return tensor.copy_(self.all_reduce(tensor.contiguous()))
        started = time.perf_counter() if self.timing else 0.0
        if self._shm is not None and self._shm.fits(tensor):  # (the same choice on every rank: same size)
            self._shm.all_reduce(tensor)
        else:
            self._pg.allreduce([tensor]).wait()
        if self.timing:
            self._timed(started)
        return tensor

    def _timed(self, started: float) -> None:
        self.collective_seconds += time.perf_counter() - started
        self.collective_calls += 1

    def gather_last_dim(self, tensor: torch.Tensor, total: int) -> torch.Tensor | None:
        """Each rank's slice of the last dimension (rank order, equal widths but the last rank's, which
        may be narrower) joined on rank 0 and cut to `total`; None on the other ranks."""
        if self._pg is None:
            return tensor
        started = time.perf_counter() if self.timing else 0.0
        width = -(-total // self.world_size)
        local = tensor if tensor.shape[-1] == width else F.pad(tensor, (0, width - tensor.shape[-1]))
        local = local.contiguous()
        outputs = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._pg.gather([outputs] if self.rank == 0 else [], [local], options).wait()
        if self.timing:
            self._timed(started)
        if self.rank != 0:
            return None
        return torch.cat(outputs, dim=-1)[..., :total]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pool size all ranks can hold)."""
        if self._pg is None:
            return value
        values = torch.zeros(self.world_size, dtype=torch.int64, device=self.device_of_collectives)
        values[self.rank] = value
        self._pg.allreduce([values]).wait()  # (a sum of one value per slot: every rank's value)
        return int(values.min())

    @property
    def device_of_collectives(self) -> torch.device:
        """Where tensors given to the collectives live: the GPU under NCCL, else the CPU."""
        if self._pg is not None and self._pg.name() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def close(self) -> None:
        """Release the group's connections (its peers may already be gone)."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.shutdown()
            self._pg = None


SINGLE = TPGroup()


def init_group(
    rank: int,
    world_size: int,
    store_path: str,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    shm_path: str | None = None,
    peers_alive: Callable[[], bool] | None = None,
) -> TPGroup:
    """Join the group of `world_size` ranks meeting at the file `store_path` (blocks until all have).
    `shm_path`: the file of the shared-memory all-reduce (CPU), whose waits give up once `peers_alive`
    says a peer is gone."""
    store = dist.FileStore(store_path, world_size)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return TPGroup(rank, world_size, dist.ProcessGroupNCCL(store, rank, world_size, options))
    gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    shm = None
    if shm_path is not None:
        shm = ShmAllReduce(shm_path, rank, world_size, peers_alive or (lambda: True), timeout_s)
    return TPGroup(rank, world_size, gloo, shm)


_building = SINGLE  # the group layers are split over while a model is built (see `building_for`)


@contextlib.contextmanager
def building_for(group: TPGroup) -> Iterator[None]:
    """Build a model's layers split over `group` (layers read `building_group()` in their constructor,
    so model files need not pass the group down)."""
    global _building
    _building, previous = group, _building
    try:
        yield
    finally:
        _building = previous


def building_group() -> TPGroup:
    return _building
