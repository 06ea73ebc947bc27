"""This process's tensor-parallel group (its rank, its world size, the few collectives the layers call), and
its pipeline stage.

World size 1 is the plain single-process engine: `SINGLE` does no communication at all, and the layers
decide once, when they are built, whether they communicate, so a single-rank step runs as before.

For N > 1 every rank builds its own torch.distributed process group object (no default group: nothing
global, so one process may run several engines in turn, as the tests do): gloo on the CPU, NCCL on CUDA,
meeting through a file store in the engine's private runtime directory. Under pipeline parallel each
stage has its own tensor-parallel group, and a `PipeLink` (engine_core/parallel/pipeline.py) over every
rank carries activations between the stages. On the CPU (x86-64) all-reduces
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

from pagoda.engine_core.parallel.pipeline import PipeLink
from pagoda.engine_core.parallel.shm_allreduce import ShmAllReduce
from pagoda.engine_core.parallel.stage import WHOLE, Stage

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


def init_groups(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    store: str | dist.Store,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    shm_paths: list[str | None] | None = None,
    peers_alive: Callable[[], bool] | None = None,
    bind_host: str | None = None,
) -> tuple[TPGroup, PipeLink | None]:
    """Join the groups of global rank `rank` among `tensor_parallel_size x pipeline_parallel_size`
    ranks meeting at `store` (blocks until all have): rank r is tensor-parallel rank r % T of stage
    r // T. Returns its stage's tensor-parallel group and, with more than one stage, the link to the
    other stages. `store`: a file on one machine, or rank 0's TCPStore (its address on the other ranks:
    tcp://host:port) when the ranks span machines, where gloo binds `bind_host` (this rank's node
    address, which the others reach). `shm_paths`: each stage's shared-memory all-reduce file (CPU;
    None for a stage that is not on one machine), whose waits give up once `peers_alive` says a peer
    is gone."""
    world = tensor_parallel_size * pipeline_parallel_size
    timeout = timedelta(seconds=timeout_s)
    store = open_store(store, world, timeout) if isinstance(store, str) else store
    stage, tp_rank = divmod(rank, tensor_parallel_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pipe = None
    if pipeline_parallel_size > 1:
        pg = _process_group(dist.PrefixStore("pipe/", store), rank, world, device, timeout, bind_host)
        pipe = PipeLink(Stage(stage, pipeline_parallel_size), tensor_parallel_size, rank, pg)
    if tensor_parallel_size == 1:
        return TPGroup(), pipe
    tp_store = dist.PrefixStore(f"stage{stage}/", store)
    pg = _process_group(tp_store, tp_rank, tensor_parallel_size, device, timeout, bind_host)
    shm = None
    shm_path = shm_paths[stage] if shm_paths is not None else None
    if shm_path is not None and device.type == "cpu":
        shm = ShmAllReduce(shm_path, tp_rank, tensor_parallel_size, peers_alive or (lambda: True), timeout_s)
    return TPGroup(tp_rank, tensor_parallel_size, pg, shm), pipe


def open_store(address: str, world: int, timeout: timedelta) -> dist.Store:
    """A rank's view of where the group meets: tcp://host:port is rank 0's TCPStore, anything else a
    file on this machine."""
    if address.startswith("tcp://"):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        return dist.TCPStore(host, int(port), world, False, timeout)
    return dist.FileStore(address, world)


def host_store(host: str, world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.Store, str]:
    """Rank 0's TCPStore on `host` (a free port), and the address the other ranks open it at."""
    store = dist.TCPStore(host, 0, world, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, f"tcp://{host}:{store.port}"


def _process_group(store, rank: int, size: int, device: torch.device, timeout: timedelta, bind_host: str | None):
    """NCCL on CUDA, gloo on the CPU: a group object of its own (no default group: nothing global).
    Gloo binds `bind_host` when given (across machines; else the address this host name resolves to)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if bind_host is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_options._timeout = timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(store, rank, size, gloo_options)


# What a model being built is split over (see `building_for`).
_building: tuple[TPGroup, Stage, bool] = (SINGLE, WHOLE, False)


@contextlib.contextmanager
def building_for(group: TPGroup, stage: Stage = WHOLE, expert_parallel: bool = False) -> Iterator[None]:
    """Build a model's layers split over `group`, holding `stage`'s layers only; with `expert_parallel`,
    a mixture of experts places whole experts on the group's ranks instead of splitting each one
    (engine_core/models/moe.py). Layers and models read `building_group()`, `building_stage()` and
    `building_expert_parallel()` in their constructor, so model files need not pass them down."""
    global _building
    _building, previous = (group, stage, expert_parallel), _building
    try:
        yield
    finally:
        _building = previous


def building_group() -> TPGroup:
    return _building[0]


def building_stage() -> Stage:
    return _building[1]


def building_expert_parallel() -> bool:
    """Whether the experts of the model being built are placed whole on the ranks (only meaningful
    with a tensor-parallel group of more than one rank)."""
    return _building[2]
