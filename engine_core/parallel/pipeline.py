"""Pipeline parallel: the point-to-point link between a rank's stage and its neighbours.

A model split into S stages runs a step as a relay: the first stage embeds the tokens and runs its layers,
then hands its activations (hidden states and the residual stream, one [2, tokens, hidden] tensor) to
the next stage, and so on; the last stage applies the final norm and sends the rows the LM head needs
(the sampling rows and any prompt-logprob rows, a few KB per request) back to the first stage, which
holds the LM head next to the embedding (shared when tied), so rank 0 samples exactly as without
pipelining. Each tensor-parallel rank talks to the rank with the same tensor-parallel index in the
neighbouring stage (their activations are identical: the all-reduces give every rank the same bits).

Sends are asynchronous (at most one outstanding per link, waited before the next), receives block. Every
rank sees the steps in the same order (the broadcast ring), so the sends and receives pair up in order.
The link is a torch.distributed group over all ranks: gloo on the CPU (loopback TCP on one host), NCCL on
CUDA; a dead peer fails the next transfer, a hung one after the group's timeout.
"""

from __future__ import annotations

import torch

from pagoda.engine_core.parallel.stage import Stage


class PipeLink:
    def __init__(self, stage: Stage, tensor_parallel_size: int, rank: int, process_group):
        self.stage = stage
        self._tp = tensor_parallel_size
        self._rank = rank
        self._pg = process_group
        self._sending: tuple[object, torch.Tensor] | None = None  # (work, tensor kept alive until done)

    @property
    def device(self) -> torch.device:
        """Where tensors given to the link live: the GPU under NCCL, else the CPU."""
        if self._pg.name() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _peer(self, stage: int) -> int:
        return stage * self._tp + self._rank % self._tp

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        self.wait_sent()
        tensor = tensor.contiguous()
        self._sending = (self._pg.send([tensor], self._peer(stage), 0), tensor)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self._pg.recv([tensor], self._peer(stage), 0).wait()
        return tensor

    def wait_sent(self) -> None:
        """Wait until the last send has been taken (its buffer may then be reused)."""
        if self._sending is not None:
            work, _ = self._sending
            self._sending = None
            work.wait()  # type: ignore[attr-defined]

    def send_activations(self, activations: torch.Tensor) -> None:
        """To the next stage: this stage's output, [2, tokens, hidden] (hidden states, residual)."""
        self._send(activations, self.stage.index + 1)

    def recv_activations(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """From the previous stage: its output for a step of `num_tokens` tokens."""
        return self._recv((2, num_tokens, hidden_size), dtype, self.stage.index - 1)

    def send_rows(self, rows: torch.Tensor) -> None:
        """From the last stage to the first: the final hidden rows the LM head runs on."""
        self._send(rows, 0)

    def recv_rows(self, num_rows: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """On the first stage: the last stage's final hidden rows."""
        return self._recv((num_rows, hidden_size), dtype, self.stage.count - 1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`, over all stages (the KV pool size all can hold)."""
        world = self._tp * self.stage.count
        values = torch.zeros(world, dtype=torch.int64, device=self.device)
        values[self._rank] = value
        self._pg.allreduce([values]).wait()
        return int(values.min())

    def close(self) -> None:
        """Release the link's connections (its peers may already be gone)."""
        import contextlib

        self._sending = None
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.shutdown()
            self._pg = None
