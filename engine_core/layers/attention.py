"""Paged attention as the model sees it: write this step's K/V into the cache, then attend.

`AttentionMetadata` describes the step's flattened batch. Requests whose query is a single token
(decodes) come first in the batch and are served by one batched decode call; the rest (prefill chunks,
possibly over a cached prefix) by the varlen prefill call.

Pooling models keep no KV cache (every prompt runs whole, in one step): their steps carry
`VarlenMetadata` instead, and attention runs within each sequence over this step's own K/V, causal for
a decoder, bidirectional for an encoder (`causal=False`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.kernels import ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [G, T] int64: cache slot of each new token, in each KV group's blocks
    num_decodes: int  # the first `num_decodes` sequences (and tokens) are single-token decodes
    seq_lens: torch.Tensor  # [B] int64: context length after this step
    max_decode_seq_len: int  # max(seq_lens) over the decode sequences (0 if none)
    block_tables: torch.Tensor  # [G, B, max_blocks] int64: each KV group's (engine_core/kv_groups.py)
    query_start_loc: torch.Tensor  # [B+1] int64, for the prefill sequences (relative to them)
    # Every prefill sequence starts at position 0 (no cached prefix, not a later chunk): its K/V are all
    # in this step's k/v, so attention needs no gather from the cache.
    prefills_from_start: bool = False
    # The rows whose final hidden states the step reads (LM head, prompt logprobs), sorted; None: all of
    # them. Past the last layer's attention, the other rows feed nothing (see LlamaForCausalLM.forward).
    output_rows: torch.Tensor | None = None
    # Rows from this one on are bulk rows, long prompts' (engine_core/model_runner.py BULK_PROMPT_TOKENS),
    # which the linears may compute on another unit; None: none are. `bulk_output_rows_from`: the same
    # among `output_rows`.
    bulk_rows_from: int | None = None
    bulk_output_rows_from: int | None = None
    # Models with recurrent layers (engine_core/state_pool.py): [B] each sequence's state slot, in the order
    # of seq_lens; [B] bool, the sequences this step starts at position 0 (None: none does).
    state_slots: torch.Tensor | None = None
    fresh_states: torch.Tensor | None = None


@dataclass
class VarlenMetadata:
    """A step of whole sequences with no KV cache (pooling): sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1]."""

    query_start_loc: torch.Tensor  # [B+1] int64
    bulk_rows_from: int | None = None  # (as AttentionMetadata's; pooling steps set none)


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        causal: bool = True,
    ):
        super().__init__()
        self.causal = causal
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        # A learned logit per head that joins the softmax denominator (gpt-oss's attention sinks; a family
        # that has them sets a parameter [num_heads] here). None: plain softmax.
        self.sinks: nn.Parameter | None
        self.register_parameter("sinks", None)
        # Attention logit soft-capping (Gemma 2): each scaled score s becomes softcap * tanh(s / softcap)
        # before the mask and the softmax; 0: off. A family that caps sets it (and `scale`) per layer.
        self.softcap = 0.0
        self.key_cache: torch.Tensor | None = None  # bound by the model runner
        self.value_cache: torch.Tensor | None = None
        self.kv_group = 0  # whose block tables and slots it uses (engine_core/kv_groups.py), bound with them
        # A group whose K/V rows are smaller than the pool's views the pool as `block_scale` times as many
        # blocks of its own shape: pool block b is its block b * block_scale (KVLayout.block_scales).
        self.block_scale = 1
        # False: a layer that reads another layer's K/V (Gemma 4's KV-shared layers), bound to that layer's
        # cache; it is given that layer's k/v of the step and writes nothing.
        self.writes_kv = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | VarlenMetadata
    ) -> torch.Tensor:
        """q `[T, H, D]`, k/v `[T, Hkv, D]` -> `[T, H, D]`."""
        if isinstance(meta, VarlenMetadata):
            return ops.varlen_attention(
                q,
                k,
                v,
                meta.query_start_loc,
                self.scale,
                self.causal,
                self.sliding_window if self.causal else None,
                sinks=self.sinks,
                softcap=self.softcap,
            )
        slot_mapping, block_tables = meta.slot_mapping[self.kv_group], meta.block_tables[self.kv_group]
        if self.block_scale != 1:
            assert self.key_cache is not None
            block_size = self.key_cache.shape[1]
            block_tables = block_tables * self.block_scale
            slot_mapping = slot_mapping + (slot_mapping // block_size) * ((self.block_scale - 1) * block_size)
        if self.writes_kv:
            ops.reshape_and_cache(k, v, self.key_cache, self.value_cache, slot_mapping)
        nd = meta.num_decodes  # one token each, so also the number of decode tokens
        if nd == q.shape[0]:
            return ops.paged_decode_attention(
                q,
                self.key_cache,
                self.value_cache,
                block_tables,
                meta.seq_lens,
                self.scale,
                self.sliding_window,
                meta.max_decode_seq_len,
                sinks=self.sinks,
                softcap=self.softcap,
            )
        out = torch.empty_like(q) if nd else None  # (a step of prompts alone returns the kernel's own output)
        if out is not None:
            out[:nd] = ops.paged_decode_attention(
                q[:nd],
                self.key_cache,
                self.value_cache,
                block_tables[:nd],
                meta.seq_lens[:nd],
                self.scale,
                self.sliding_window,
                meta.max_decode_seq_len,
                sinks=self.sinks,
                softcap=self.softcap,
            )
        if meta.prefills_from_start and q.device.type == "cpu":
            # The compiled C kernel reads this step's k/v rows in place: 3.6x faster than gathering the
            # cache for torch's attention (512-token prompt, SmolLM2's heads, one thread; docs/decode-speed.md).
            prefill = ops.varlen_attention(
                q[nd:],
                k[nd:],
                v[nd:],
                meta.query_start_loc,
                self.scale,
                True,
                self.sliding_window,
                sinks=self.sinks,
                softcap=self.softcap,
            )
        else:
            prefill = ops.paged_prefill_attention(
                q[nd:],
                self.key_cache,
                self.value_cache,
                block_tables[nd:],
                meta.query_start_loc,
                meta.seq_lens[nd:],
                self.scale,
                self.sliding_window,
                sinks=self.sinks,
                softcap=self.softcap,
            )
        if out is None:
            return prefill
        out[nd:] = prefill
        return out
