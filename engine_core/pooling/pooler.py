"""From a step's final hidden states [tokens, hidden] (whole prompts, packed) to each request's output."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.engine_core.pooling.params import PoolingParams

_EPS = 1e-12  # as sentence-transformers' Normalize (torch.nn.functional.normalize)


def pool(hidden: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One row per sequence [B, hidden]: the mean of its rows, its first row (CLS) or its last row."""
    if pooling_type == "cls":
        return hidden[starts]
    if pooling_type == "last":
        return hidden[starts + lens - 1]
    if pooling_type == "mean":
        # One matmul with an averaging matrix (1/len over each sequence's own rows; the step's other rows
        # belong to other requests): a scatter-add over the rows, or a small mean per sequence, costs
        # 10-100x more on the CPU.
        weights = np.zeros((len(lens), hidden.shape[0]), dtype=np.float32)
        for row, (start, size) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
            weights[row, start : start + size] = 1.0 / size
        return torch.from_numpy(weights).to(hidden.device) @ hidden.float()
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def outputs(
    hidden: torch.Tensor, starts: list[int], lens: list[int], params: list[PoolingParams], pooling_type: str, normalize
) -> list[torch.Tensor]:
    """Each request's float32 output on the CPU: its embedding [hidden] ("embed": pooled, cut to
    `dimensions`, then normalized if the request or else the model says so) or its tokens' hidden
    states [len, hidden] ("token_embed", normalized per token only if the request asks)."""
    out: list[torch.Tensor | None] = [None] * len(params)
    embed = [i for i, p in enumerate(params) if p.task == "embed"]
    if embed:
        index = torch.tensor(embed, device=hidden.device)
        device_starts = torch.tensor(starts, device=hidden.device)[index]
        device_lens = torch.tensor(lens, device=hidden.device)[index]
        pooled = pool(hidden, device_starts, device_lens, pooling_type).float()
        # The common case in one call: every embedding whole and normalized.
        at_once = all(params[i].dimensions is None and _normalizes(params[i], normalize) for i in embed)
        if at_once:
            pooled = F.normalize(pooled, dim=-1, eps=_EPS)
        pooled = pooled.cpu()
        for j, i in enumerate(embed):
            vector = pooled[j, : params[i].dimensions]
            if not at_once and _normalizes(params[i], normalize):
                vector = F.normalize(vector, dim=-1, eps=_EPS)
            out[i] = vector
    for i, p in enumerate(params):
        if p.task == "token_embed":
            rows = hidden[starts[i] : starts[i] + lens[i]].float()
            out[i] = (F.normalize(rows, dim=-1, eps=_EPS) if p.normalize else rows).cpu()
    return [o for o in out if o is not None]


def _normalizes(params: PoolingParams, model_default: bool) -> bool:
    return model_default if params.normalize is None else params.normalize
