"""All-reduce through shared memory, for the tensor-parallel ranks of one host on the CPU.

gloo's all-reduce goes through TCP sockets and thread wake-ups: about 0.1 ms for a decode step's hidden
states on an idle machine, milliseconds on a loaded one, times two per layer. Here each rank copies its
partial sum into its own slot of a memory-mapped file (in the group's private runtime directory, so it
goes away with it), publishes a sequence number, waits until every rank has published the same number,
and adds the slots up in rank order: every rank computes the same sum in the same order, so all hold
the same bits, as with gloo. Tensors larger than a slot go through gloo instead (the same choice on
every rank: they have the same size everywhere).

Two slots per rank, used alternately: a rank can run at most one all-reduce ahead of another (it waits
for everyone's number each time), so it never overwrites a slot that a slower rank is still reading.

Ordering: a rank writes its slot, then its number; the others read the number, then the slot. That is
safe where stores become visible in program order and loads are not reordered with each other (x86-64's
memory model), so this path is used on x86-64 only (`supported`).

Waiting spins briefly, then yields the core; it gives up with a RuntimeError when a peer is gone
(`peers_alive`) or after `timeout_s`.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # per rank and parity: a decode step's hidden states, and prefill chunks up to 4 MiB
_LINE = 64  # bytes between two ranks' sequence numbers (one cache line: no false sharing)
_SPINS = 200  # busy checks before each yield
_CHECK_EVERY = 1024  # yields between checks of the clock and the peers


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def file_size(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return _LINE * world_size + 2 * world_size * slot_bytes


def create_file(path: str, world_size: int, slot_bytes: int = SLOT_BYTES) -> None:
    """The zero-filled file the ranks map (made by rank 0 before the others start)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, file_size(world_size, slot_bytes))
    finally:
        os.close(fd)


class ShmAllReduce:
    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        peers_alive: Callable[[], bool],
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
    ):
        self.rank, self.world_size = rank, world_size
        self.slot_bytes = slot_bytes
        self.peers_alive = peers_alive
        self.timeout_s = timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, file_size(world_size, slot_bytes))
        finally:
            os.close(fd)
        self._numbers = np.frombuffer(self._map, dtype=np.int64, count=_LINE // 8 * world_size)[:: _LINE // 8]
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_LINE * world_size)
        self._slots = data.view(2, world_size, slot_bytes)  # [parity, rank, bytes]
        self._sequence = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.slot_bytes

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (contiguous, `fits`) over the ranks, in place."""
        self._sequence += 1
        sequence = self._sequence
        nbytes = tensor.numel() * tensor.element_size()
        slots = [s[:nbytes].view(tensor.dtype).view(tensor.shape) for s in self._slots[sequence & 1]]
        slots[self.rank].copy_(tensor)
        self._numbers[self.rank] = sequence  # (after the slot: see the module's note on ordering)
        for rank in range(self.world_size):
            if rank != self.rank:
                self._wait(rank, sequence)
        tensor.copy_(slots[0])
        for slot in slots[1:]:
            tensor += slot

    def _wait(self, rank: int, sequence: int) -> None:
        numbers = self._numbers
        spins = 0
        deadline = None
        while numbers[rank] < sequence:
            spins += 1
            if spins < _SPINS:
                continue
            os.sched_yield()
            if spins % _CHECK_EVERY:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} did not join an all-reduce within {self.timeout_s:g}s")
            if not self.peers_alive():
                raise RuntimeError(f"a tensor-parallel rank is gone (rank {rank} never joined an all-reduce)")

    def close(self) -> None:
        self._slots = self._numbers = None  # type: ignore[assignment]  # (views of the map: released first)
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: it goes when that does
            pass
