"""`PoolingEngineCore`: the engine for pooling (embedding) models, stepped like `EngineCore`.

The same interface as the generating engine where the engine process, the offline `LLM` and tests use
it (add_request / abort_request / step / has_unfinished_requests / check_integrity / warm_up, the
scheduler's stats), so they serve either kind; a step's deltas carry `pooled` vectors and finish every
request they name. No KV cache (why: engine_core/pooling/__init__.py), no structured output, one
process (neither tensor nor pipeline parallel).
"""

from __future__ import annotations

import logging
import time

import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.cpu_binding import apply as apply_cores
from pagoda.engine_core.cpu_binding import assign as assign_cores
from pagoda.engine_core.loader import resolve_model
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models import is_encoder
from pagoda.engine_core.pooling.config import pooler_config
from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.pooling.runner import PoolingRunner
from pagoda.engine_core.pooling.scheduler import PoolingRequest, PoolingScheduler
from pagoda.engine_core.protocol import (
    FinishReason,
    PooledVectors,
    RequestDelta,
    RequestFailed,
    RequestRejected,
    SchedulerStatsMessage,
)
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.validation import ParamError, check_token_ids

logger = logging.getLogger(__name__)


class PoolingEngineCore:
    pooling = True

    def __init__(self, config: EngineConfig, model_dir=None, model_cfg: ModelConfig | None = None):
        started = time.monotonic()
        if config.num_ranks > 1:
            raise ValueError("a pooling model runs in one process: no tensor or pipeline parallel")
        self.config = config
        cores = assign_cores(config.cpu_threads_bind, 1)
        apply_cores(cores[0] if cores is not None else None, config.num_threads)
        torch.manual_seed(config.seed)
        self.model_dir = model_dir if model_dir is not None else resolve_model(config.model)
        self.model_cfg = model_cfg if model_cfg is not None else ModelConfig.from_dir(self.model_dir)
        self.pooler = pooler_config(config, self.model_dir, self.model_cfg, is_encoder(self.model_cfg.architecture))
        self.runner = PoolingRunner(config, self.model_dir, self.model_cfg, self.pooler)
        self.max_model_len = self._max_model_len()
        self.scheduler = PoolingScheduler(config.max_num_batched_tokens, config.max_num_seqs)
        logger.info(
            "Pooling engine: inputs of up to %d tokens, %d tokens per step; model %s loaded in %.1fs",
            self.max_model_len,
            config.max_num_batched_tokens,
            self.model_cfg.architecture,
            time.monotonic() - started,
        )

    def _max_model_len(self) -> int:
        """The longest input: the model's positions, sentence-transformers' max_seq_length (what the model
        was trained on, and where sentence-transformers truncates), `--max-model-len`, and the step budget
        (a prompt runs whole in one step)."""
        limit = self.model_cfg.max_position_embeddings
        wanted = self.config.max_model_len or min(limit, self.pooler.max_seq_length or limit)
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        budget = self.config.max_num_batched_tokens
        if wanted > budget:
            logger.warning(
                "inputs run whole in one step: max_model_len lowered from %d to --max-num-batched-tokens %d",
                wanted,
                budget,
            )
            wanted = budget
        return wanted

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a pooling request; ValueError (a ParamError naming the field) if it cannot be served.
        `params` and `cache_salt` are a generating request's: a request without `pooling` is refused."""
        if pooling is None:
            raise ParamError(
                "this model is an embedding model: it does not generate text (use /v1/embeddings or /pooling)",
                "model",
            )
        if not prompt_token_ids:
            raise ParamError("the input is empty", "input")
        if len(prompt_token_ids) > self.max_model_len:
            raise ParamError(
                f"the input has {len(prompt_token_ids)} tokens; this model's maximum input length is "
                f"{self.max_model_len} tokens",
                "input",
            )
        check_token_ids(prompt_token_ids, self.model_cfg.vocab_size, "input")
        p = self.pooler
        pooling.validate(p.hidden_size, p.matryoshka, p.matryoshka_dimensions)
        self.scheduler.add_request(PoolingRequest(request_id, list(prompt_token_ids), pooling))

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def take_ended(self) -> list[RequestRejected | RequestFailed]:
        return []  # (every refusal happens in add_request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_integrity(self) -> None:
        if not self.scheduler.has_unfinished() and (self.scheduler.running or self.scheduler.waiting):
            raise AssertionError("idle pooling engine still holds requests")

    def stats(self) -> SchedulerStatsMessage:
        """The scheduler's stats (what every step's StepOutputs carries), as `EngineCore.stats`."""
        return self.scheduler.stats()

    def check_health(self) -> None:
        """(One process: nothing else to watch.)"""

    def close(self) -> None:
        """(Nothing to stop.)"""

    def reset_prefix_cache(self) -> int:
        return 0  # (no cache)

    def warm_up(self) -> None:
        """Pool one input of a few blocks' length, so the first user request pays no first-call costs."""
        started = time.monotonic()
        prompt = list(range(1, min(self.max_model_len, 32) + 1))
        self.add_request("__warm_up__", prompt, pooling=PoolingParams())
        while self.has_unfinished_requests():
            self.step()
        logger.info("warm-up step run in %.2fs", time.monotonic() - started)

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run the waiting requests that fit one step; one finishing delta with its vectors each."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            results = self.runner.execute(batch)
        finally:
            done = self.scheduler.finish()
        vectors = {r.request_id: v for r, v in zip(batch, results, strict=True)}
        return [
            RequestDelta(
                request_id=r.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.STOP,
                queue_time=r.queue_time,
                pooled=PooledVectors.pack(vectors[r.request_id]),
            )
            for r in done
        ]

    @property
    def num_preemptions(self) -> int:
        return 0
