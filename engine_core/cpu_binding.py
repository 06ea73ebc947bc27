"""Which CPU cores each of several engine processes may run its threads on (`--cpu-threads-bind`).

Several processes doing matmuls on one machine (data-parallel replicas, tensor-parallel ranks) are
slower when their OpenMP threads float over the same cores: they evict each other's caches and
oversubscribe the cores. Each gets a disjoint set of cores instead, and as many torch threads as cores.

A spec is one of:
  "auto"          one group of whole physical cores per process, the machine's cores divided evenly
                  (contiguous, one logical CPU per physical core; cores left over stay free for the
                  tokenizer and HTTP processes). With a single process: no pinning at all.
  "none"          no pinning (each process uses torch's default threads on every core).
  "0-3|4-7"       one group per process, '|' between groups; a group lists CPUs and ranges ("0,2,4-6").
                  There must be exactly one group per process, the groups disjoint, every CPU usable.

`assign(spec, world)` gives the groups of the engine processes; `divide_own(spec, world)` divides one
engine's cores between its tensor/pipeline-parallel ranks. The process that owns a group calls
`apply(group)` before its first parallel region. Like vLLM's VLLM_CPU_OMP_THREADS_BIND, with the same
spelling.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)
CoreSet = tuple[int, ...]


def parse_group(text: str) -> CoreSet:
    """'0,2,4-6' -> (0, 2, 4, 5, 6)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ValueError(f"cannot read {text!r} as CPUs (e.g. 0-3 or 0,2,4)") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"a CPU is listed twice in {text!r}")
    return tuple(cpus)


def format_groups(groups: Sequence[CoreSet]) -> str:
    """The explicit spec for `groups` ('0,1|2,3'), which `assign` reads back as they are."""
    return "|".join(",".join(map(str, group)) for group in groups)


def check_spec(spec: str) -> None:
    """Raise ValueError for a spec that cannot be read (the number of groups is checked by `assign`)."""
    if spec not in ("auto", "none"):
        for group in spec.split("|"):
            parse_group(group)


def assign(spec: str, world: int, available: Sequence[int] | None = None) -> list[CoreSet] | None:
    """The core group of each of `world` processes, or None for no pinning. `available`: the CPUs this
    process may use (default: its affinity mask)."""
    if world < 1:
        raise ValueError("world must be at least 1")
    if spec == "none" or (spec == "auto" and world == 1):
        return None
    usable = sorted(os.sched_getaffinity(0) if available is None else available)
    if spec == "auto":
        return _divide(_one_per_physical_core(usable), usable, world)
    groups = [parse_group(group) for group in spec.split("|")]
    if len(groups) != world:
        raise ValueError(f"--cpu-threads-bind {spec!r} has {len(groups)} group(s) for {world} process(es)")
    seen: set[int] = set()
    for group in groups:
        if seen & set(group):
            raise ValueError(f"--cpu-threads-bind {spec!r}: groups share CPU(s) {sorted(seen & set(group))}")
        seen |= set(group)
    unusable = sorted(seen - set(usable))
    if unusable:
        raise ValueError(f"--cpu-threads-bind {spec!r}: CPU(s) {unusable} are not usable here (usable: {usable})")
    return groups


def _divide(cores: list[int], usable: list[int], world: int) -> list[CoreSet]:
    if len(cores) < world:  # fewer physical cores than processes: fall back to logical CPUs
        cores = usable
    if len(cores) < world:
        raise ValueError(
            f"--cpu-threads-bind auto cannot give {world} processes a CPU each: only {len(cores)} usable "
            "(pass --cpu-threads-bind none to share them)"
        )
    size = len(cores) // world
    return [tuple(cores[i * size : (i + 1) * size]) for i in range(world)]


def _one_per_physical_core(cpus: list[int]) -> list[int]:
    """The first logical CPU of each physical core among `cpus` (SMT siblings share a core's units, so
    a thread on each sibling runs no faster than one); all of `cpus` where the topology is unknown."""
    seen: set[tuple[str, str]] = set()
    first = []
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topology / "physical_package_id").read_text(), (topology / "core_id").read_text())
        except OSError:
            return cpus
        if core not in seen:
            seen.add(core)
            first.append(cpu)
    return first


def divide_own(spec: str, world: int) -> list[CoreSet] | None:
    """The cores of each of `world` ranks sharing this process's cores (one engine's parallel ranks):
    its affinity mask (the engine's own group) divided evenly, one logical CPU per physical core where
    there are enough. None (no pinning) for spec "none", and, with a warning, when there are fewer CPUs
    than ranks. Called before this process pins itself: the ranks it starts inherit its mask."""
    if spec == "none":
        return None
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < world:
        logger.warning("%d parallel ranks share %d CPU(s): they will be slow", world, len(usable))
        return None
    return _divide(_one_per_physical_core(usable), usable, world)


def apply(cores: CoreSet | None, num_threads: int | None = None) -> None:
    """`bind` to `cores`, or without cores just set torch's thread count to `num_threads` if given."""
    if cores:
        bind(cores, num_threads)
    elif num_threads:
        import torch

        torch.set_num_threads(num_threads)


def bind(cores: CoreSet, num_threads: int | None = None) -> None:
    """Pin this process to `cores` and give torch one thread per core (or `num_threads`). Call it in the
    process before its first parallel region: OpenMP threads inherit the mask when they are created."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(num_threads or len(cores))
