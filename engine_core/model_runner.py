"""Turns a scheduled step into model inputs, runs the model and samples.

Owns the model, the KV cache tensors (one key and one value tensor per layer, bound into each attention
layer) and the sampler. The batch is laid out decodes first, so attention serves all single-token
queries in one batched call, and long prompts' chunks last: their rows are the step's bulk rows
(`BULK_PROMPT_TOKENS`), whose float32 projections may run on another unit of the CPU.

Under tensor parallel every rank has a runner holding its shard of the model and of the KV cache (its
K/V heads). Rank 0 hands each step's inputs to its `followers` (the executor sends them to the other
ranks, whose runners `follow` them) before running the model: every rank then runs the same forward
pass and calls the LM head on the same rows (`LogitsRows`), because both are collective.

Under pipeline parallel a runner holds one stage's layers and their KV cache. A step is `submit`ted
(rank 0 runs the first stage and passes the activations on) and later `finish`ed (the last stage's
final hidden rows come back, rank 0 samples), so that up to one step per stage is in flight. Without
pipelining `execute` does both at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from pagoda.engine_core.config import EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from pagoda.engine_core.cuda_graphs import DecodeGraphs, model_capturable
from pagoda.engine_core.environment import configure_kernels
from pagoda.engine_core.gpu_memory import profile_gpu_memory
from pagoda.engine_core.kv_groups import KVLayout
from pagoda.engine_core.kv_pool import allocate_pool, bind_pool, kv_bytes_per_block, plan_model_layout
from pagoda.engine_core.kv_prefault import KVPoolPrefault, prefault
from pagoda.engine_core.layers.attention import AttentionMetadata
from pagoda.engine_core.loader import load_model, weight_bytes
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.parallel.distributed import SINGLE, TPGroup
from pagoda.engine_core.parallel.pipeline import PipeLink
from pagoda.engine_core.parallel.stage import WHOLE
from pagoda.engine_core.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs, row_chunks
from pagoda.engine_core.protocol import TokenLogprobs
from pagoda.engine_core.quantization import resolve_method
from pagoda.engine_core.request import Request
from pagoda.engine_core.scheduler import SchedulerOutput
from pagoda.engine_core.speculative.draft_model import DraftModel
from pagoda.engine_core.speculative.verify import verify
from pagoda.engine_core.step_inputs import StepInputs, prepare_decode_step, prepare_step
from pagoda.kernels import ops

logger = logging.getLogger(__name__)
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
# A prompt of at least this many tokens computes its rows as bulk rows: the linears may take them on Intel's
# AMX (kernels/cpu/amx_matmul.c), which a call pays for once (it splits every weight into bf16 pieces) and
# then runs 1.3-1.5x as fast as the panel matmul. A step's rows of a model's projections, one call each
# (docs/decode-speed.md): level at 64-80 rows, 1.17x at 96, 1.39x at 256. Whether a row is bulk depends
# on its request alone (never on the batch around it; a chunk of one token excepted, see `_bulk`), so a
# request's numbers, and its seeded samples, stay the same in any batch. (A block served from the prefix cache holds
# what the request that first computed it computed, as bulk rows or not; the two round differently in the
# last bits, so there a sample can depend on what ran before. PAGODA_DISABLE_AMX=1: every row alike.)
BULK_PROMPT_TOKENS = 96
# The block count a rank whose layers keep no K/V can hold (a pipeline stage of recurrent layers alone):
# the smallest over the ranks is what every rank allocates.
NO_KV_LIMIT = 1 << 40


@dataclass
class StepResult:
    # request id -> its new tokens (one; with speculation the accepted proposals and one more), for
    # requests whose prompt is fully computed
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]  # request id -> packed logprobs per new token, when asked for
    # request id -> the prompt logprobs this step's tokens gave, for requests that still owe them
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    # requests that sampled no token because their logits were not finite (NaN or infinite): failed
    failed: set[str] = field(default_factory=set)


@dataclass
class LogitsRows:
    """The hidden rows a step computes logits for, in the order the LM head runs on them: each prompt-
    logprob span in chunks of `max_num_seqs` rows (`row_chunks`), then the sampling rows."""

    prompt_spans: np.ndarray  # [S, 2] int64: (first row, end row) of each request's prompt-logprob rows
    sample_rows: np.ndarray  # [R] int64: the last row of each request that samples

    def indices(self) -> np.ndarray:
        """Every row the LM head runs on, prompt spans first: those a last pipeline stage sends back."""
        spans = [np.arange(start, stop) for start, stop in self.prompt_spans.tolist()]
        return np.concatenate([*spans, self.sample_rows]).astype(np.int64)


class Followers(Protocol):
    """Rank 0's way to the other ranks (the executor): each step's inputs before rank 0 runs it, and
    under pipeline parallel word that rank 0 runs a step's LM head."""

    def broadcast_step(self, step: StepInputs, rows: LogitsRows) -> None: ...

    def broadcast_head(self) -> None: ...


@dataclass
class PendingStep:
    """A step `submit` started: what `finish` needs to complete it."""

    requests: list[Request]  # in batch order
    counts: list[int]
    sampling: list[tuple[Request, int]]  # (request, its first sampling row): one row, or one per proposal + 1
    proposals: dict[str, list[int]]  # request id -> the proposals this step verifies
    wanted: list[tuple[Request, range, int, int]]  # see _prompt_logprob_rows
    rows: LogitsRows
    num_tokens: int
    hidden: torch.Tensor | None  # the final hidden states, unless a later pipeline stage has them


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir,
        model_cfg: ModelConfig,
        group: TPGroup = SINGLE,
        pipe: PipeLink | None = None,
        draft_model: str | None = None,
    ):
        """`group`: the tensor-parallel group this runner is a rank of (its shard of the model and KV);
        `pipe`: its link to the other pipeline stages (None: it runs every layer); `draft_model`: the path
        of a speculative draft model this runner (rank 0's) runs beside the target, with its own KV pool
        of as many blocks (engine_core/speculative/draft_model.py)."""
        configure_kernels(
            config.int8_activations
        )  # which kernels this process may use (PAGODA_DISABLE_*), before any runs
        self.config = config
        self.model_cfg = model_cfg = replace(model_cfg, max_model_len=config.max_model_len)  # (LongRoPE reads it)
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        self.quantization = resolve_method(config.quantization, model_cfg.raw)
        fp8_matmul = {"auto": None, "on": True, "off": False}[config.fp8_matmul]
        self.tp = group
        self.pipe = pipe
        self.stage = pipe.stage if pipe is not None else WHOLE
        self.model = load_model(
            model_dir,
            model_cfg,
            self.dtype,
            self.device,
            config.load_format,
            self.quantization,
            fp8_matmul,
            group,
            self.stage,
            config.enable_expert_parallel,
        )
        self.num_layers = len(self.model.attention_layers())  # this stage's
        self.weight_bytes = weight_bytes(self.model)
        logger.info(
            "Weights: %s, %.1f MiB in memory%s",
            "full precision" if self.quantization is None else self.quantization.describe(),
            self.weight_bytes / 2**20,
            _rank_description(group, self.stage),
        )
        self.draft = (
            None
            if draft_model is None
            else DraftModel(draft_model, model_dir, model_cfg, self.dtype, self.device, self.block_size)
        )
        self.kv_layout = self._plan_kv_layout()
        # A recurrent state slot per running request (engine_core/state_pool.py), allocated before the KV
        # pool is sized (on a GPU, the profile sees it in use); none for a model without recurrent layers.
        self.num_state_slots = config.max_num_seqs if self.model.recurrent_layers() else 0
        # Rows after the slots' for states kept at block boundaries, what a cached prefix resumes from
        # (engine_core/state_snapshots.py); none where prefix caching is off.
        self.num_state_snapshots = (
            config.recurrent_state_snapshots if self.num_state_slots and config.enable_prefix_caching else 0
        )
        self.state_bytes = self._allocate_state_pool()
        # Long prompts' rows as bulk rows, where the linears then compute them otherwise (AMX; float32 panels)
        self.bulk_prompts = self.dtype == torch.float32 and ops.bulk_rows_differ(self.device)
        self.decode_graphs: DecodeGraphs | None = None  # set by enable_decode_graphs
        self.followers: Followers | None = None  # set by the parallel executor on rank 0
        self.kv_cache: torch.Tensor | None = None
        self.kv_prefault: KVPoolPrefault | None = None
        # Every rank sizes its own pool (each profiles its own GPU); all use the smallest.
        num_blocks = group.min_int(self._num_blocks())
        self.allocate_kv_cache(pipe.min_int(num_blocks) if pipe is not None else num_blocks)
        self._heads_owed: deque[tuple[LogitsRows, int]] = deque()  # a first-stage follower's steps (rows, tokens)

    def _plan_kv_layout(self) -> KVLayout:
        """The KV groups of this rank's layers (engine_core/kv_groups.py), from the windows the model
        declares for its layers (which the layers it built must agree with). A pipeline stage, or a model
        with a draft (whose K/V lives in blocks of the same ids), keeps one group; there every layer's
        window, the draft's too, must be the same for the group to slide."""
        models = [self.model] + ([self.draft.model] if self.draft is not None else [])
        for model in models:
            declared = model.attention_windows()
            for index, attention in zip(model.attention_layer_indices(), model.attention_layers(), strict=True):
                if attention.sliding_window != declared[index]:
                    raise RuntimeError(
                        f"{type(model).__name__}: layer {index} attends with window {attention.sliding_window},"
                        f" but the family declares {declared[index]}"
                    )
        windows = self.model.attention_windows()
        if self.draft is not None and set(self.draft.model.attention_windows()) != set(windows):
            windows = [None] * len(windows)  # (the draft attends otherwise: every block is kept)
        return plan_model_layout(self.model, windows, split=self.pipe is None and self.draft is None)

    def _allocate_state_pool(self) -> int:
        """Bind each recurrent layer its state pools, `num_state_slots` + 1 rows (row 0: padding rows') and
        `num_state_snapshots` more, zeroed; returns their bytes."""
        total = 0
        if not self.num_state_slots:
            return total
        rows = self.num_state_slots + 1 + self.num_state_snapshots
        for layer in self.model.recurrent_layers():
            (conv_shape, conv_dtype), (state_shape, state_dtype) = self.model.recurrent_state_shapes()
            layer.conv_states = torch.zeros((rows, *conv_shape), dtype=conv_dtype, device=self.device)
            layer.recurrent_states = torch.zeros((rows, *state_shape), dtype=state_dtype, device=self.device)
            total += layer.conv_states.nbytes + layer.recurrent_states.nbytes
        logger.info(
            "Recurrent state pool: %d slots (one per running request) and %d snapshots (for cached prefixes)"
            " x %.2f MiB = %.1f MiB, beside the KV pool",
            self.num_state_slots,
            self.num_state_snapshots,
            total / rows / 2**20,
            total / 2**20,
        )
        return total

    def _copy_states(self, copies: np.ndarray | None) -> None:
        """Copy recurrent states between rows of every recurrent layer's pools, [N, 2] (source, destination)
        rows: snapshots into slots, or slots into snapshots (engine_core/state_snapshots.py)."""
        if copies is None or not len(copies):
            return
        source = torch.from_numpy(np.ascontiguousarray(copies[:, 0])).to(self.device)
        destination = torch.from_numpy(np.ascontiguousarray(copies[:, 1])).to(self.device)
        for layer in self.model.recurrent_layers():
            for name in ("conv_states", "recurrent_states"):
                pool: torch.Tensor = getattr(layer, name)
                pool.index_copy_(0, destination, pool.index_select(0, source))

    def _num_blocks(self) -> int:
        per_block = kv_bytes_per_block(self.kv_layout, self.block_size, self.kv_cache_dtype)
        if self.draft is not None:  # every block exists in both pools
            per_block += self.draft.kv_bytes_per_block()
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if per_block == 0:  # (a stage without attention layers: the other stages' pools set the size)
            return NO_KV_LIMIT
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory // per_block
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_MEMORY // per_block
        max_len = min(
            self.config.max_model_len or self.model_cfg.max_position_embeddings, self.model_cfg.max_position_embeddings
        )
        profile = profile_gpu_memory(
            self,
            min(self.config.max_num_batched_tokens, max_len),
            max_len,
            capture_graphs=not self.config.enforce_eager
            and not self.tp.parallel
            and self.pipe is None
            and model_capturable(self.model, self.device),
        )
        budget = profile.kv_cache_bytes(self.config.gpu_memory_utilization)
        if budget < 2 * per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {profile.total / 2**30:.1f} GiB x "
                f"{self.config.gpu_memory_utilization} utilization leaves {budget / 2**30:.2f} GiB after "
                f"{profile.in_use / 2**30:.2f} GiB in use and a {profile.activation_peak / 2**30:.2f} GiB "
                "activation peak; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        logger.info(
            "KV cache gets %.2f GiB (--gpu-memory-utilization %.2f)", budget / 2**30, self.config.gpu_memory_utilization
        )
        return budget // per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One key and one value tensor per layer slot of a block (engine_core/kv_groups.py), bound into the
        attention layers with their KV group (engine_core/kv_pool.py)."""
        self.release_kv_cache()
        self.num_blocks = num_blocks
        # torch.empty: nothing is written up front; on the CPU a background thread maps the pages before
        # blocks need them (engine_core/kv_prefault.py), instead of a page fault at a block's first write.
        self.kv_cache = allocate_pool(self.kv_layout, num_blocks, self.block_size, self.kv_cache_dtype, self.device)
        self.kv_cache[:, :, 0].zero_()  # (the null block: what sliding groups' given-back entries point at)
        self.kv_prefault = prefault(self.kv_cache)
        bind_pool(self.model, self.kv_layout, self.kv_cache, self.block_size)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)

    def wait_for_kv_pages(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the background threads mapping the CPU pools' pages (target and
        draft) to finish; True when none is left running."""
        deadline = time.monotonic() + timeout
        jobs = [self.kv_prefault, self.draft.kv_prefault if self.draft is not None else None]
        return all(job.done.wait(max(0.0, deadline - time.monotonic())) for job in jobs if job is not None)

    def release_kv_cache(self) -> None:
        for attn in self.model.attention_layers():
            attn.key_cache = attn.value_cache = None
        if self.kv_prefault is not None:
            self.kv_prefault.stop()
        self.kv_cache = self.kv_prefault = None
        if self.draft is not None:
            self.draft.release_kv_cache()

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def enable_decode_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Route pure-decode steps through persistent buffers, replaying captured CUDA graphs when
        `capture` (CUDA only); with capture=False the same path runs eager (how the CPU tests use it)."""
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.config.max_num_seqs,
            max_model_len,
            self.block_size,
            self.device,
            capture,
            len(self.kv_layout.groups),
        )
        if capture:
            self.decode_graphs.capture_all()

    # ---- one step -----------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run the model on one scheduled batch and sample.

        In: `Scheduler.schedule()`'s output, whose requests hold KV slots for their scheduled tokens and
        whose `num_computed_tokens` already counts them. The K/V of every scheduled token is written to
        the cache (decodes are laid out first; a pure-decode batch replays a CUDA graph when enabled).
        Out: one sampled token, and packed logprobs if it asked for them, per request whose tokens are
        now all computed; a prefill chunk that stops short of the prompt's end samples nothing. For a
        request owing prompt logprobs, the rows its scheduled prompt positions give. Tokens and prompt
        logprobs are not added to the requests here (that is `EngineCore.step`); the requests change
        only in their random generators, which sampling advances.
        """
        return self.finish(self.submit(sched))

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> PendingStep:
        """Start a step (the first half of `execute`): send its inputs to the other ranks and run the
        model, or under pipeline parallel the first stage, whose activations go on to the next."""
        order, bulk_requests = _layout(sched.requests, sched.num_scheduled_tokens, self.bulk_prompts)
        requests = [sched.requests[i] for i in order]
        counts = [sched.num_scheduled_tokens[i] for i in order]
        proposals = sched.spec_token_ids
        step = prepare_step(requests, counts, self.block_size, proposals, bulk_requests)
        step.state_loads, step.state_saves = _copies(sched.state_loads), _copies(sched.state_saves)
        sampling = []  # a request samples once its tokens are all computed: at its last row, or at each proposal
        for i, r in enumerate(requests):
            drafts = proposals.get(r.request_id, ())
            if r.num_computed_tokens - len(drafts) == r.num_tokens:
                sampling.append((r, step.last_token_index[i] - len(drafts)))
        wanted = self._prompt_logprob_rows(requests, counts, step)
        spans = np.array([(start, stop) for _, _, start, stop in wanted], dtype=np.int64).reshape(-1, 2)
        sample_rows = [row + j for r, row in sampling for j in range(1 + len(proposals.get(r.request_id, ())))]
        rows = LogitsRows(spans, np.array(sample_rows, dtype=np.int64))
        if self.followers is not None:
            self.followers.broadcast_step(step, rows)
        graphs = self.decode_graphs
        inputs = None
        if graphs is not None and step.num_decodes == len(requests) and graphs.padded_size(len(requests)):
            hidden = graphs.run(
                step.token_ids, step.positions, step.slot_mapping, step.seq_lens, [r.block_ids for r in requests]
            )
        else:
            inputs = self.to_device(step, rows)
            self._copy_states(step.state_loads)
            hidden = self.model(*inputs)
            self._copy_states(step.state_saves)
        if self.draft is not None:  # the draft's K/V for every token the target computes, in the same slots
            self.draft.model(*(inputs or self.to_device(step)))
        pending = PendingStep(requests, counts, sampling, proposals, wanted, rows, len(step.token_ids), hidden)
        if self.pipe is not None:
            self.pipe.send_activations(hidden)
            pending.hidden = None
        return pending

    @torch.inference_mode()
    def finish(self, pending: PendingStep) -> StepResult:
        """Complete a step `submit` started: under pipeline parallel, receive the last stage's final
        hidden rows; then the LM head, prompt logprobs and sampling (see `execute`)."""
        hidden = pending.hidden
        if self.pipe is not None:
            if self.followers is not None and self.tp.parallel:
                self.followers.broadcast_head()
            hidden = self._receive_final_rows(pending.rows, pending.num_tokens)
        prompt_logprobs = {}
        for request, positions, start, stop in pending.wanted:
            assert hidden is not None and request.prompt_logprobs is not None  # (only such requests are wanted)
            next_tokens = request.all_token_ids[positions.start + 1 : positions.stop + 1]
            targets = torch.tensor(next_tokens, dtype=torch.int64, device=hidden.device)
            num_top = request.prompt_logprobs.num_top
            arrays = compute_prompt_logprobs(self.model, hidden[start:stop], targets, num_top, self.config.max_num_seqs)
            prompt_logprobs[request.request_id] = PromptLogprobsChunk(positions.start + 1, *arrays)
        if not pending.sampling:
            return StepResult({}, {}, prompt_logprobs)
        assert hidden is not None
        logits = self.model.compute_logits(hidden[torch.from_numpy(pending.rows.sample_rows).to(self.device)])
        assert logits is not None  # (rank 0 gets the gathered logits)
        # One logits row per request, or per proposal plus one of a request that verifies proposals.
        requests = [r for r, _ in pending.sampling]
        drafts = [pending.proposals.get(r.request_id, []) for r in requests]
        sampled, logprobs, failed = verify(logits, requests, drafts, self.model_cfg.vocab_size)
        return StepResult(sampled, logprobs, prompt_logprobs, failed)

    @torch.inference_mode()
    def draft_logits(self, requests: list[Request], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """The draft model's logits [B, V] for one token per request (`token_ids` at `positions`, whose
        K/V it writes into the request's slots, which must exist): one step of proposing."""
        assert self.draft is not None
        step = prepare_decode_step(requests, token_ids, positions, self.block_size)
        hidden = self.draft.model(*self.to_device(step))
        logits = self.draft.model.compute_logits(hidden)
        assert logits is not None
        return logits

    def _receive_final_rows(self, rows: LogitsRows, num_tokens: int) -> torch.Tensor | None:
        """The final hidden states of a step's LM-head rows, from the last pipeline stage, in place in a
        [tokens, hidden] tensor (its other rows unset); None when the step has no such rows."""
        assert self.pipe is not None
        indices = rows.indices()
        if not len(indices):
            return None
        received = self.pipe.recv_rows(len(indices), self.model_cfg.hidden_size, self.dtype).to(self.device)
        hidden = torch.empty(num_tokens, self.model_cfg.hidden_size, dtype=self.dtype, device=self.device)
        hidden[torch.from_numpy(indices).to(self.device)] = received
        return hidden

    @torch.inference_mode()
    def follow(self, step: StepInputs, rows: LogitsRows) -> None:
        """What a rank other than 0 does for a step rank 0 runs: the same forward pass (its stage's, from
        the previous stage's activations) and, on the first stage, the same LM head calls (whose logits
        go to rank 0), at once without pipelining, else when rank 0 says (`follow_head`). A middle stage
        passes its activations on; the last sends the LM head's rows back to the first."""
        activations = None
        if not self.stage.is_first:
            assert self.pipe is not None
            activations = self.pipe.recv_activations(len(step.token_ids), self.model_cfg.hidden_size, self.dtype)
            activations = activations.to(self.device)
        self._copy_states(step.state_loads)
        out = self.model(*self.to_device(step, rows), activations)
        self._copy_states(step.state_saves)
        if self.pipe is None:
            self._run_heads(out, rows)
            return
        if not self.stage.is_last:
            self.pipe.send_activations(out)
        else:
            indices = rows.indices()
            if len(indices):
                self.pipe.send_rows(out[torch.from_numpy(indices).to(self.device)])
        if self.stage.is_first:
            self._heads_owed.append((rows, len(step.token_ids)))

    @torch.inference_mode()
    def follow_head(self) -> None:
        """Join rank 0's LM head for the oldest step this first-stage rank ran (pipeline parallel)."""
        if not self.stage.is_first:
            return
        rows, num_tokens = self._heads_owed.popleft()
        hidden = self._receive_final_rows(rows, num_tokens)
        if hidden is not None:
            self._run_heads(hidden, rows)

    def _run_heads(self, hidden: torch.Tensor, rows: LogitsRows) -> None:
        for start, stop in rows.prompt_spans.tolist():
            for first, end in row_chunks(stop - start, self.config.max_num_seqs):
                self.model.compute_logits(hidden[start + first : start + end])
        if len(rows.sample_rows):
            self.model.compute_logits(hidden[torch.from_numpy(rows.sample_rows).to(self.device)])

    def _prompt_logprob_rows(
        self, requests: list[Request], counts: list[int], step: StepInputs
    ) -> list[tuple[Request, range, int, int]]:
        """(request, prompt positions, first row, end row) for each request that still owes prompt
        logprobs of this step's positions. At most max_num_seqs rows of logits exist at once: the step
        profiled for GPU memory (gpu_memory.py) holds that many for sampling, so prompt logprobs need no
        memory the KV pool could lack."""
        out = []
        for i, (request, count) in enumerate(zip(requests, counts, strict=True)):
            collector = request.prompt_logprobs
            if collector is None:
                continue
            end = request.num_computed_tokens  # the step computed positions [end - count, end)
            positions = collector.positions_wanted(end - count, end)
            if not positions:
                continue
            row_of_position_0 = step.last_token_index[i] - (end - 1)  # rows are positions, shifted
            out.append((request, positions, row_of_position_0 + positions.start, row_of_position_0 + positions.stop))
        return out

    def to_device(
        self, step: StepInputs, rows: LogitsRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs on the device. `rows`: the rows whose final hidden states will be read; a
        step with prefill rows then computes only those past its last layer's attention (every rank and
        stage must pass the same)."""
        to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        # (recurrent layers take each sequence's tokens in order, from its one state slot: no splitting)
        seq_lens, block_tables, num_decodes, query_start_loc = _attention_rows(step, not self.num_state_slots)
        output_rows, bulk_output_rows_from = None, step.bulk_rows_from
        if rows is not None and num_decodes < len(step.token_ids):
            needed = np.unique(rows.indices())
            if len(needed) < len(step.token_ids):
                output_rows = to(needed)
                if step.bulk_rows_from is not None:  # (where the bulk rows start among the kept ones)
                    bulk_output_rows_from = int(np.searchsorted(needed, step.bulk_rows_from))
        meta = AttentionMetadata(
            slot_mapping=to(step.slot_mapping),
            num_decodes=num_decodes,
            seq_lens=to(seq_lens),
            max_decode_seq_len=int(seq_lens[:num_decodes].max(initial=0)),
            block_tables=to(block_tables),
            query_start_loc=to(query_start_loc),
            prefills_from_start=bool((seq_lens[num_decodes:] == np.diff(query_start_loc)).all()),
            output_rows=output_rows,
            bulk_rows_from=step.bulk_rows_from,
            bulk_output_rows_from=bulk_output_rows_from,
        )
        if self.num_state_slots and step.state_slots is not None and step.fresh_states is not None:
            meta.state_slots = to(step.state_slots)
            meta.fresh_states = to(step.fresh_states) if step.fresh_states.any() else None
        return to(step.token_ids), to(step.positions), meta


# Query chunks of at most this many tokens attend as that many decodes (see `_attention_rows`).
_SHORT_CHUNK_TOKENS = 16


def _attention_rows(
    step: StepInputs, split_short_chunks: bool = True
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """(seq_lens, block_tables, num_decodes, query_start_loc) for attention. When every query chunk in
    the step is short (a speculative verification: the last token and its proposals; a prompt's short
    tail), each of its tokens attends as a decode of its own: the same block table, the context up to
    itself (its K/V and its predecessors' are in the cache before attention runs, so that is causal
    attention). The decode kernel then serves the whole step, instead of the prefill path gathering each
    chunk's whole context from the cache (a verification step cost 1.4x a plain decode step that way)."""
    nd = step.num_decodes
    q_lens = np.diff(step.query_start_loc)
    if not split_short_chunks or len(q_lens) == 0 or q_lens.max() > _SHORT_CHUNK_TOKENS:
        return step.seq_lens, step.block_tables, nd, step.query_start_loc
    counts = np.concatenate([np.ones(nd, dtype=np.int64), q_lens])
    num_tokens = int(counts.sum())
    last_row = np.repeat(np.cumsum(counts) - 1, counts)  # each token's sequence's last row
    seq_lens = np.repeat(step.seq_lens, counts) - (last_row - np.arange(num_tokens))
    block_tables = np.repeat(step.block_tables, counts, axis=1)
    return seq_lens, block_tables, num_tokens, np.zeros(1, dtype=np.int64)


def _layout(requests: list[Request], counts: list[int], bulk_prompts: bool = True) -> tuple[list[int], int]:
    """The step's order of `requests` (each computing `counts` tokens): single-token chunks (decodes),
    then other chunks, then chunks of long prompts (`BULK_PROMPT_TOKENS`) if `bulk_prompts`; and how many
    of those."""
    bulk = [bulk_prompts and _bulk(request, count) for request, count in zip(requests, counts, strict=True)]
    order = sorted(range(len(requests)), key=lambda i: (bulk[i], counts[i] != 1))
    return order, sum(bulk)


def _bulk(request: Request, count: int) -> bool:
    """Whether a request's rows this step are bulk rows: a chunk of a long prompt. Not a chunk of one
    token (a fully cached prompt's last, say): that attends as a decode, whatever is batched with it, so
    it computes as one too. (A preempted request's recomputation counts its generated tokens with the
    prompt chunk they fall in.)"""
    start = request.num_computed_tokens - count  # (already advanced by the scheduler)
    return count > 1 and request.num_prompt_tokens >= BULK_PROMPT_TOKENS and start < request.num_prompt_tokens


def _rank_description(group: TPGroup, stage) -> str:
    parts = []
    if group.parallel:
        parts.append(f"tensor-parallel rank {group.rank} of {group.world_size}")
    if stage.count > 1:
        parts.append(f"pipeline stage {stage.index + 1} of {stage.count}")
    return f" ({', '.join(parts)})" if parts else ""


def _copies(pairs: list[tuple[int, int]]) -> np.ndarray | None:
    """A scheduler's (source, destination) state copies as StepInputs carries them; None for none."""
    return np.array(pairs, dtype=np.int64).reshape(-1, 2) if pairs else None
