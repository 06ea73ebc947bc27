"""Which slice of a checkpoint dimension each tensor-parallel rank holds, and whether a model splits at all.

- Rows (gate/up outputs, the down projection's inputs): `total / N` each; when N does not divide them,
  rank r holds [r * total // N, (r + 1) * total // N), so the ranks differ by one row at most.
- Attention heads (`AttentionHeads`): whole K/V heads per rank, each with its group of query heads, split
  the same way when N does not divide them (SmolLM2's 3 K/V heads over 2 ranks: 1 and 2). With more
  ranks than K/V heads (a multiple of them), each K/V head is held by `N / kv_heads` ranks (replicated)
  and its query heads are split between those ranks. A rank's query heads always find their K/V head.
- Vocabulary (embedding and LM head rows): `ceil(V / N)` each, the last rank's possibly fewer.
- Experts under expert parallel (`split_experts`): whole experts, a contiguous range per rank, `E // N`
  each and one more on each of the first `E % N` ranks (vLLM's placement: 60 experts over 8 ranks are
  8, 8, 8, 8, 7, 7, 7, 7). Without it each expert's intermediate rows are split as a dense MLP's;
  MXFP4 experts' (gpt-oss) in whole blocks of 32 rows (`expert_row_unit`), since their down projection
  stores its columns, those rows, in blocks of 32 with one scale each.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine_core.quantization import checkpoint_method_name

# Values per scale of an MXFP4 block (kernels/mxfp4.py GROUP; this module imports no torch).
MXFP4_BLOCK = 32


@dataclass(frozen=True)
class Span:
    """The slice [start, start + size) of one dimension of a checkpoint tensor."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def slice(self) -> slice:
        return slice(self.start, self.stop)

    def scaled(self, factor: int) -> Span:
        """The same slice in units `factor` times smaller (heads -> rows of a head_dim each)."""
        return Span(self.start * factor, self.size * factor)


def split_rows(total: int, rank: int, world_size: int, unit: int = 1) -> Span:
    """Rank `rank`'s rows of `total`; with `unit`, in whole units of that many rows (`total` a multiple of
    it), the ranks differing by one unit at most."""
    if total % unit:
        raise ValueError(f"{total} rows do not split in whole units of {unit}")
    units = total // unit
    start, stop = rank * units // world_size, (rank + 1) * units // world_size
    return Span(start * unit, (stop - start) * unit)


def expert_row_unit(model_cfg) -> int:
    """The units in which each expert's intermediate rows split over the ranks: whole MXFP4 blocks where
    the checkpoint stores its experts MXFP4 (gpt-oss: the down projection's columns are those rows, 32 to
    a block and its scale), else single rows."""
    return MXFP4_BLOCK if checkpoint_method_name(model_cfg.raw) == "mxfp4" else 1


def split_vocab(vocab_size: int, rank: int, world_size: int) -> Span:
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return Span(start, min(per_rank, vocab_size - start))


def split_experts(num_experts: int, rank: int, world_size: int) -> Span:
    """The experts rank `rank` holds under expert parallel: `num_experts // world_size`, plus one on the
    first `num_experts % world_size` ranks."""
    base, extra = divmod(num_experts, world_size)
    return Span(rank * base + min(rank, extra), base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class AttentionHeads:
    """A model's attention heads; `of_rank` says which query and K/V heads a rank holds."""

    num_heads: int
    num_kv_heads: int

    def of_rank(self, rank: int, world_size: int) -> tuple[Span, Span]:
        """(query heads, K/V heads) of rank `rank`, in heads; a ValueError if the heads do not split."""
        kv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        if world_size <= kv:
            kv_heads = split_rows(kv, rank, world_size)
            return kv_heads.scaled(group), kv_heads
        sharing = world_size // kv  # ranks per K/V head
        if world_size % kv or group < sharing:
            raise ValueError(
                f"tensor_parallel_size {world_size} cannot split {self.num_heads} attention heads with "
                f"{kv} key/value heads: above {kv} it must be a multiple of {kv} and at most {self.num_heads}"
            )
        head = rank // sharing
        part = split_rows(group, rank % sharing, sharing)
        return Span(head * group + part.start, part.size), Span(head, 1)


def check_model_splits(model_cfg, world_size: int, pipeline_stages: int = 1, expert_parallel: bool = False) -> None:
    """A clear error, before any process starts, if the model cannot be split over `world_size`
    tensor-parallel ranks and `pipeline_stages` stages (each at least one layer); `expert_parallel`:
    a mixture of experts' experts placed whole on the ranks."""
    if pipeline_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, not {pipeline_stages}")
    if pipeline_stages > model_cfg.num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pipeline_stages} exceeds the model's {model_cfg.num_layers} layers "
            "(each stage holds at least one)"
        )
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, not {world_size}")
    if world_size == 1:
        return
    heads = AttentionHeads(model_cfg.num_heads, model_cfg.num_kv_heads)
    for rank in range(world_size):
        heads.of_rank(rank, world_size)
    linear_heads = [int(model_cfg.raw.get(k) or 0) for k in ("linear_num_key_heads", "linear_num_value_heads")]
    if any(heads % world_size for heads in linear_heads):
        raise ValueError(
            f"tensor_parallel_size {world_size} must divide the linear attention's {linear_heads[0]} key heads and "
            f"{linear_heads[1]} value heads"
        )
    if model_cfg.intermediate_size and model_cfg.intermediate_size < world_size:  # (0: every MLP is experts)
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the model's intermediate size {model_cfg.intermediate_size}"
        )
    if split_vocab(model_cfg.vocab_size, world_size - 1, world_size).size == 0:
        raise ValueError(f"tensor_parallel_size {world_size} is too large for a vocabulary of {model_cfg.vocab_size}")
    if not model_cfg.is_moe:
        return
    if expert_parallel and model_cfg.num_experts < world_size:
        raise ValueError(
            f"--enable-expert-parallel places whole experts on the {world_size} tensor-parallel ranks, but the "
            f"model has {model_cfg.num_experts} experts: use at most {model_cfg.num_experts} ranks, or split "
            "each expert over the ranks (without --enable-expert-parallel)"
        )
    if not expert_parallel and model_cfg.moe_intermediate_size < world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the experts' intermediate size "
            f"{model_cfg.moe_intermediate_size}: use fewer ranks, or --enable-expert-parallel"
        )
    unit = expert_row_unit(model_cfg)
    if not expert_parallel and unit > 1:
        blocks, remainder = divmod(model_cfg.moe_intermediate_size, unit)
        if remainder:
            raise ValueError(
                f"the MXFP4 experts' intermediate size {model_cfg.moe_intermediate_size} is not a multiple of "
                f"their blocks of {unit}"
            )
        if blocks < world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} cannot split the MXFP4 experts' intermediate size "
                f"{model_cfg.moe_intermediate_size}: it splits in whole blocks of {unit} rows, {blocks} of them; "
                f"use at most {blocks} ranks, or --enable-expert-parallel"
            )
    if model_cfg.shared_expert_intermediate_size and model_cfg.shared_expert_intermediate_size < world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the shared expert's intermediate size "
            f"{model_cfg.shared_expert_intermediate_size}"
        )
