"""`EngineCore`: the plain, in-process engine: add requests, `step()`, read per-step outputs.

No sockets and no threads here; the server wraps this in a process that adds them, and tests and the
offline `LLM` drive it directly. Under tensor or pipeline parallel this process is rank 0 and owns the
executor that starts the other ranks (engine_core/parallel/executor.py); `close()` stops them. Under
pipeline parallel a step returns the outputs of the oldest step in flight, having started the next ones.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.cpu_binding import apply as apply_cores
from pagoda.engine_core.cpu_binding import assign as assign_cores
from pagoda.engine_core.cuda_graphs import model_capturable
from pagoda.engine_core.host_memory import keep_freed_memory
from pagoda.engine_core.kv_cache import KVCacheManager
from pagoda.engine_core.loader import resolve_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.model_runner import ModelRunner, PendingStep, StepResult
from pagoda.engine_core.parallel.sharding import check_model_splits
from pagoda.engine_core.pooling.config import runs_pooling
from pagoda.engine_core.pooling.engine import PoolingEngineCore
from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.protocol import RequestDelta, RequestFailed, RequestRejected, SchedulerStatsMessage
from pagoda.engine_core.request import Request
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.scheduler import Scheduler, SchedulerOutput
from pagoda.engine_core.speculative.config import SpeculativeConfig
from pagoda.engine_core.speculative.draft import DraftProposer
from pagoda.engine_core.speculative.proposer import NgramProposer, Proposer
from pagoda.engine_core.speculative.stats import SpecDecodeCounters
from pagoda.engine_core.structured_output import StructuredOutputManager
from pagoda.engine_core.validation import ParamError, check_token_ids

if TYPE_CHECKING:
    from pagoda.engine_core.parallel.ranks import WorkerRanks

logger = logging.getLogger(__name__)

# What a client whose request's logits were not finite is told (the log has the request id).
NON_FINITE_LOGITS = (
    "the model's logits for this request were not finite (NaN or infinity), so no token could be "
    "sampled; the request was stopped (other requests are not affected)"
)
# What a client whose request raised inside the engine is told: never the exception's text (logged).
REQUEST_RAISED = "this request failed inside the engine; the server log has the details under its request id"

# The most seconds the warm-up waits, once its request has run, for the KV pool's pages to be mapped
# (engine_core/kv_prefault.py). A 2 GiB pool on this machine kind took 0.9 s on two threads beside the
# warm-up, 0.27 s of it after, so a server is ready with its pool mapped and no step pays for a page
# fault; a much larger pool is not worth delaying ready for, and keeps being mapped behind it.
KV_PAGES_BEFORE_READY = 2.0


def create_engine(config: EngineConfig, ranks: WorkerRanks | None = None) -> EngineCore | PoolingEngineCore:
    """The engine `config` asks for: a `PoolingEngineCore` for an embedding model (`--runner pooling`, or
    an encoder under `auto`), else the generating `EngineCore` (its parallel ranks started by `ranks`:
    child processes unless the Ray backend gives its own)."""
    model_dir = resolve_model(config.model)
    model_cfg = ModelConfig.from_dir(model_dir)
    if runs_pooling(config, model_cfg.architecture):
        return PoolingEngineCore(config, model_dir, model_cfg)
    return EngineCore(config, ranks)


def _proposer(
    config: SpeculativeConfig | None, max_model_len: int, runner: ModelRunner, kv: KVCacheManager
) -> Proposer | None:
    """The proposer of the speculative method `config` names (None: no speculation)."""
    if config is None:
        return None
    if runner.num_state_slots:
        raise ValueError(
            f"--speculative-config: {runner.model_cfg.architecture} has recurrent layers, whose state cannot step"
            " back over rejected proposals: speculative decoding is not supported for it"
        )
    if config.method == "ngram":
        return NgramProposer(config, max_model_len)
    assert runner.draft is not None
    limit = runner.draft.model_cfg.max_position_embeddings
    if limit < max_model_len:
        raise ValueError(
            f"--speculative-config: the draft model's context ({limit} tokens) is shorter than max_model_len "
            f"({max_model_len}): pass --max-model-len {limit} or less"
        )
    return DraftProposer(config, max_model_len, runner, kv)


class EngineCore:
    pooling = False  # (a PoolingEngineCore's is True)

    def __init__(self, config: EngineConfig, ranks: WorkerRanks | None = None):
        started = time.monotonic()
        keep_freed_memory()  # before the model loads (engine_core/host_memory.py says why then)
        self.config = config
        cores = assign_cores(config.cpu_threads_bind, 1)  # a replica gets its own group from the launcher
        apply_cores(cores[0] if cores is not None else None, config.num_threads)
        torch.manual_seed(config.seed)
        self.model_dir = resolve_model(config.model)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        self.executor = None
        self.speculative = SpeculativeConfig.parse(config.speculative_config, config.speculative_disable_batch_size)
        draft_model = self.speculative.model if self.speculative is not None else None  # (draft_model only)
        if config.num_ranks > 1:
            from pagoda.engine_core.parallel.executor import ParallelExecutor

            check_model_splits(
                self.model_cfg,
                config.tensor_parallel_size,
                config.pipeline_parallel_size,
                config.enable_expert_parallel,
            )
            self.executor = ParallelExecutor(config, str(self.model_dir), ranks=ranks)
            # The workers are stopped when this engine is closed or collected, whichever comes first.
            self._finalizer = weakref.finalize(self, self.executor.close)
            try:
                executor = self.executor
                self.runner = ModelRunner(
                    executor.rank_config(config, 0),
                    self.model_dir,
                    self.model_cfg,
                    executor.group,
                    executor.pipe,
                    draft_model,
                )
            except BaseException:
                self.executor.close()
                raise
            self.runner.followers = self.executor
        else:
            self.runner = ModelRunner(config, self.model_dir, self.model_cfg, draft_model=draft_model)
        # Steps started and not yet finished, oldest first: one per pipeline stage at most (one without
        # pipeline parallel, finished in the step that starts it).
        self.in_flight: deque[tuple[SchedulerOutput, PendingStep]] = deque()
        recurrent = self.runner.num_state_slots > 0
        if recurrent and config.enable_prefix_caching and not self.runner.num_state_snapshots:
            logger.info(
                "prefix caching is off: %s's recurrent layers keep no state snapshots to resume a cached prefix"
                " from (--recurrent-state-snapshots 0)",
                self.model_cfg.architecture,
            )
        self.kv_manager = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            windows=self.runner.kv_layout.windows,
            state_slots=self.runner.num_state_slots,
            state_snapshots=self.runner.num_state_snapshots,
        )
        if any(self.runner.kv_layout.windows):
            logger.info(
                "KV groups: %s; sliding groups give a request's blocks back as they leave its window",
                self.runner.kv_layout.describe(),
            )
        capacity = self.kv_manager.token_capacity(config.max_num_batched_tokens)
        if capacity == 0:
            raise ValueError(
                f"the KV cache's {self.kv_manager.pool.num_usable_blocks} blocks cannot hold one block of each of"
                f" the model's {self.kv_manager.num_groups} KV groups: give it more memory (--kv-cache-memory)"
            )
        if capacity is None:  # (every group slides: a request of any length holds its windows' blocks)
            capacity = self.model_cfg.max_position_embeddings
        self.max_model_len = self._max_model_len(capacity)
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
            config.max_joint_prefill_tokens,
        )
        if self.runner.device.type == "cuda" and not config.enforce_eager:
            if recurrent:  # (the decode graphs' inputs carry no state slots)
                logger.info("CUDA graphs are not used for models with recurrent layers: decode steps run eager")
            elif not model_capturable(self.runner.model, self.runner.device):
                logger.info(
                    "CUDA graphs are not used: the mixture-of-experts op runs its torch reference (Triton off,"
                    " quantized experts, or gpt-oss's), which reads the routing on the host; decode steps run eager"
                )
            elif self.executor is None:
                self.runner.enable_decode_graphs(self.max_model_len)
            else:  # (the workers would have to capture the same graphs, collectives included, in step)
                logger.info("CUDA graphs are not used under tensor or pipeline parallel: decode steps run eager")
        self.proposer = _proposer(self.speculative, self.max_model_len, self.runner, self.kv_manager)
        self.spec_counters = (
            None if self.speculative is None else SpecDecodeCounters(self.speculative.num_speculative_tokens)
        )
        # Constrained requests wait here, off the scheduler, while worker processes compile their grammar.
        self.structured = StructuredOutputManager(
            self.model_dir,
            self.model_cfg.vocab_size,
            self.model_cfg.eos_token_ids,
            limits=config.structured_limits(),
            compile_timeout=config.structured_output_compile_timeout,
            num_workers=config.structured_output_compile_workers,
        )
        # Its compile worker processes stop when this engine is closed or collected, whichever comes first
        # (an offline `LLM` dropped without close() would otherwise keep them until the interpreter exits).
        self._close_structured = weakref.finalize(self, self.structured.close)
        self.ended_early: list[RequestRejected | RequestFailed] = []  # see take_ended
        full_length = self.kv_manager.blocks_for(self.max_model_len, config.max_num_batched_tokens)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s; max concurrency at full context length (%d): %.2fx;"
            " model %s loaded in %.1fs",
            self.kv_manager.pool.num_usable_blocks,
            config.block_size,
            str(self.runner.kv_cache_dtype).removeprefix("torch."),
            self.max_model_len,
            self.kv_manager.pool.num_usable_blocks / full_length,
            self.model_cfg.architecture,
            time.monotonic() - started,
        )

    def _max_model_len(self, capacity: int) -> int:
        limit = self.model_cfg.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        if wanted > capacity:
            logger.warning("KV cache holds only %d tokens; max_model_len lowered from %d", capacity, wanted)
            wanted = capacity
        return wanted

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request; raises ValueError (nothing queued) if it cannot be served: a ParamError
        naming the field when a request value is to blame. `pooling`: a pooling request, which this
        generating engine refuses."""
        if pooling is not None:
            raise ParamError(
                "this model generates text: it is not an embedding model (serve one with --runner pooling)",
                "model",
            )
        if not prompt_token_ids:
            raise ParamError("the prompt is empty", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ParamError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, leaving no room to generate",
                "prompt",
            )
        vocab = self.model_cfg.vocab_size
        check_token_ids(prompt_token_ids, vocab, "prompt")
        params.validate()
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids(params.logit_bias, vocab, "logit_bias")
        if self.structured.has_pending(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        request = Request(request_id, prompt_token_ids, params, self.model_cfg.eos_token_ids, cache_salt=cache_salt)
        if params.structured_outputs is not None:
            if request_id in self.scheduler.requests:
                raise ValueError(f"duplicate request id {request_id!r}")
            self.structured.submit(request)  # scheduled once its grammar is ready, or rejected
        else:
            self.scheduler.add_request(request)

    def take_ended(self) -> list[RequestRejected | RequestFailed]:
        """Requests ended after `add_request` returned, since the last call: rejected before computing
        anything (a structured-output spec that does not compile), or failed mid-way because of their
        own data (`RequestFailed`: logits that were not finite, an error taking their tokens)."""
        ended, self.ended_early = self.ended_early, []
        return ended

    def _admit_compiled(self) -> None:
        if not self.structured.num_pending:
            return
        if not self.scheduler.has_unfinished():  # nothing else to do: sleep on the compile, not spin
            self.structured.wait(timeout=0.05)
        ready, refused = self.structured.collect()
        for request in ready:
            self.scheduler.add_request(request)
        for request, message in refused:  # the field to blame: where its structured output came from
            spec = request.params.structured_outputs
            self.ended_early.append(
                RequestRejected(request.request_id, message, spec.source if spec is not None else None)
            )

    def abort_request(self, request_id: str) -> bool:
        return self.structured.abort(request_id) or self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or steps still in flight (whose requests may all have been aborted)."""
        return self.scheduler.has_unfinished() or self.structured.num_pending > 0 or bool(self.in_flight)

    def check_integrity(self) -> None:
        """Assert the block pool's invariants, and that an idle engine holds no blocks (run by the
        engine process whenever it goes idle, and by tests after every step)."""
        pool, states = self.kv_manager.pool, self.kv_manager.states
        self.kv_manager.check_integrity()
        if not self.has_unfinished_requests() and pool.num_free_blocks != pool.num_usable_blocks:
            raise AssertionError(f"idle engine holds {pool.num_usable_blocks - pool.num_free_blocks} KV blocks")
        if not self.has_unfinished_requests() and states is not None and states.num_free != states.num_slots:
            raise AssertionError(f"idle engine holds {states.num_slots - states.num_free} recurrent state slots")

    def warm_up(self, kv_pages_wait: float = KV_PAGES_BEFORE_READY) -> None:
        """Run one short request end to end, so the first user request pays no first-call costs
        (kernel compilation, allocator growth), then give the KV pool's pages up to `kv_pages_wait` s
        more to be mapped; the engine is left idle and empty."""
        started = time.monotonic()
        prompt = list(range(1, min(self.max_model_len - 2, 2 * self.config.block_size) + 1))
        self.add_request("__warm_up__", prompt, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
        while self.has_unfinished_requests():
            self.step()
        self.check_integrity()
        self.reset_prefix_cache()
        self.kv_manager.prefix_cache_queries = self.kv_manager.prefix_cache_hits = 0  # users' traffic only
        ran = time.monotonic()
        mapped = self.runner.wait_for_kv_pages(timeout=kv_pages_wait)
        logger.info(
            "warm-up step run in %.2fs; KV pool %s %.2fs later",
            ran - started,
            "mapped" if mapped else "still being mapped",
            time.monotonic() - ran,
        )

    def check_health(self) -> None:
        """Raise if a worker rank has died (the engine process checks while it is idle; a
        step notices by itself)."""
        if self.executor is not None:
            self.executor.check_alive()

    def close(self) -> None:
        """Stop the worker ranks, if any, and the grammar compile workers (idempotent; the engine cannot
        step afterwards)."""
        self._close_structured()
        if self.executor is not None:
            self._finalizer()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (running requests keep their blocks); returns how many blocks."""
        return self.kv_manager.reset_prefix_cache()

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One iteration: admit the requests whose grammar has compiled, schedule, run the model,
        sample, append the tokens and finish the requests that stop.

        Returns one delta per request that got a token this step (one token each; none for a prefill
        chunk short of the prompt's end, so the list may be empty), with `finish_reason` set on a
        request's last delta. Requests ended by `abort_request` get no delta here, and requests
        refused after `add_request` are reported by `take_ended`. Raises RuntimeError when the
        request at the head of the queue cannot fit in the KV cache even alone.
        """
        self._admit_compiled()
        try:
            self._start_steps()
            oldest = self.in_flight.popleft() if self.in_flight else None
            result = self.runner.finish(oldest[1]) if oldest is not None else None
        except Exception as exc:
            died = self.executor.explain(exc) if self.executor is not None else None
            if died is not None:
                raise died from exc
            raise
        if oldest is None or result is None:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("the KV cache cannot hold the next waiting request even alone")
            return []
        return self._apply(oldest[0], result)

    def _start_steps(self) -> None:
        """Schedule and start steps until one per pipeline stage is in flight (one step without
        pipelining). A request in flight is not scheduled again until its step finishes (its next token
        is not known before), and a pipelined step takes its share of the requests, so that the stages
        have work at once."""
        stages = self.config.pipeline_parallel_size
        while len(self.in_flight) < stages:
            if stages == 1:
                if self.proposer is not None:
                    self.proposer.propose(self.scheduler.running)
                sched = self.scheduler.schedule()
            else:
                busy = {r.request_id for step, _ in self.in_flight for r in step.requests}
                share = -(-len(self.scheduler.requests) // stages)
                sched = self.scheduler.schedule(exclude=busy, max_requests=max(1, share))
            if not sched:
                return
            self.in_flight.append((sched, self.runner.submit(sched)))

    def _apply(self, sched: SchedulerOutput, result: StepResult) -> list[RequestDelta]:
        """Add a finished step's tokens and prompt logprobs to its requests, finish those that stop;
        the deltas to send. Requests aborted while the step was in flight get nothing."""
        live = [r for r in sched.requests if not r.status.finished]
        before = {}
        for request in live:
            before[request.request_id] = request.num_tokens
            chunk = result.prompt_logprobs.get(request.request_id)
            if chunk is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.add(chunk)
            proposed = sched.spec_token_ids.get(request.request_id)
            if proposed and request.request_id in result.sampled:
                kept = len(result.sampled[request.request_id]) - 1
                request.spec_proposed += len(proposed)
                request.spec_accepted += kept
                assert self.spec_counters is not None
                self.spec_counters.record(len(proposed), kept)
        for request_id in result.failed:
            logger.error("request %s failed: its logits were not finite (NaN or infinity)", request_id)
            if self.scheduler.abort(request_id) is not None:
                self.ended_early.append(RequestFailed(request_id, NON_FINITE_LOGITS))
        live = [r for r in live if not r.status.finished]
        finished = {r.request_id for r in self.scheduler.update_from_output(sched, result.sampled)}
        for request in self.scheduler.take_failed():  # (logged by the scheduler)
            self.ended_early.append(RequestFailed(request.request_id, REQUEST_RAISED))
            live.remove(request)
        if self.spec_counters is not None:
            self.spec_counters.maybe_log()
        outputs = []
        for request in live:
            new_tokens = request.all_token_ids[before[request.request_id] :]  # (fewer than sampled after a stop)
            if not new_tokens:
                continue
            logprobs = result.logprobs.get(request.request_id, [])[: len(new_tokens)]
            prompt_logprobs = None
            if request.prompt_logprobs is not None:  # all computed now that it samples: sent once, here
                prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs.pack(), None
            outputs.append(
                RequestDelta(
                    request_id=request.request_id,
                    new_token_ids=new_tokens,
                    finish_reason=request.finish_reason if request.request_id in finished else None,
                    new_logprobs=logprobs,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_time=request.queue_time if request.num_output_tokens == 1 else None,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return outputs

    def stats(self) -> SchedulerStatsMessage:
        """The scheduler's stats, and speculative decoding's counters when it is on."""
        stats = self.scheduler.stats()
        if self.spec_counters is not None:
            stats.spec_decode = self.spec_counters.stats
        return stats

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions_total
