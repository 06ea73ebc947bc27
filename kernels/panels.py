"""Float32 weights in panels of 16 output columns: the layout of the CPU's dense linear.

A weight `W [N, K]` is stored as `data [Np / 16, K, 16]` (Np: N rounded up to 32 with zero rows):
panel p holds output columns 16p..16p+15, one 64-byte line of them for each input column k. The C
kernel (kernels/cpu/panel_matmul.c) then reads each weight once per step as a few sequential
streams, which is what decode's handful of rows needs (why, and the measurements:
docs/decode-speed.md). It is packed once at load time and replaces the plain weight; a tied LM head's
embedding lookup reads its rows from the panels (`rows`), so no second copy is kept. A mixture-of-experts
layer's stacked expert matrices are packed the same way, expert by expert (`ExpertPanels`), for the fused
MoE kernel (kernels/cpu/moe.c).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PANEL = 16  # output columns per panel
PAD = 32  # N is padded to a multiple of this: a kernel tile covers two panels


@dataclass
class PanelWeight:
    out_features: int  # N
    in_features: int  # K
    data: torch.Tensor  # float32 [Np / 16, K, 16]

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PanelWeight:
        """Panels of `weight [N, K]` (float32; any strides)."""
        n, k = weight.shape
        padded = F.pad(weight.detach(), (0, 0, 0, (-n) % PAD))
        return cls(n, k, padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous())

    def unpack(self) -> torch.Tensor:
        """The weight `[N, K]` again."""
        return self.data.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """`W[ids]`: an embedding lookup in a tied LM head's panels (a strided gather per row)."""
        flat = ids.reshape(-1)
        picked = self.data[flat // PANEL, :, flat % PANEL]  # [len(ids), K]
        return picked.reshape(*ids.shape, self.in_features)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class ExpertPanels:
    """Stacked expert matrices `W [E, N, K]`, each expert's packed as a `PanelWeight`: `data [E, Np / 16, K,
    16]`. The fused MoE reads only the chosen experts' panels; `matrix` unpacks one for the reference."""

    out_features: int  # N, per expert
    in_features: int  # K
    data: torch.Tensor  # float32 [E, Np / 16, K, 16]

    @classmethod
    def pack(cls, weights: torch.Tensor) -> ExpertPanels:
        """Panels of every expert of `weights [E, N, K]` (float32), one expert at a time."""
        e, n, k = weights.shape
        data = torch.empty(e, -(-n // PAD) * PAD // PANEL, k, PANEL, dtype=torch.float32)
        for expert in range(e):
            data[expert] = PanelWeight.pack(weights[expert]).data
        return cls(n, k, data)

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    def matrix(self, index: int, dtype=torch.float32) -> torch.Tensor:
        """Expert `index`'s matrix `[N, K]` again (that expert's only), in `dtype`."""
        return PanelWeight(self.out_features, self.in_features, self.data[index]).unpack().to(dtype)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def reference_linear(
    x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None, bulk_rows_from: int | None = None
) -> torch.Tensor:
    """y = x W^T (+ bias) through the unpacked weight: the reference, and the path without the C kernel.

    `bulk_rows_from`: the rows of x from this index on are bulk rows (a long prompt's, see
    engine_core/model_runner.py), which the C kernel may compute on another unit (AMX) whose sums round
    differently, each row the same whatever the other rows; the reference computes all rows alike."""
    del bulk_rows_from  # (one path for every row here)
    return F.linear(x, weight.unpack(), bias)
