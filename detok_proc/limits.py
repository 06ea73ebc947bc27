"""Admission limits the tokenizer process enforces for every frontend (HTTP workers and direct
clients alike): it is the one place that sees all in-flight requests and every prompt's token count."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.detok_proc.requests import RequestInvalid


@dataclass(frozen=True)
class FrontendLimits:
    max_prompt_tokens: int | None = None  # None = only the model's context length limits prompts
    max_pending_requests: int | None = None  # running + queued engine requests (each of n samples counts)
    max_tokens_cap: int | None = None  # largest max_tokens; also the default when a request sets none
    max_batch_inputs: int | None = 2048  # inputs of one embedding request (OpenAI's limit); None: no limit
    max_batch_tokens: int | None = 65_536  # tokens of one embedding request, its inputs together
    max_token_embed_values: int | None = 4_194_304  # values (tokens x dimensions) of a per-token output

    def cap_max_tokens(self, params, num_prompt_tokens: int, max_model_len: int) -> None:
        """Refuse max_tokens above the cap; give a request without one the cap, or what the context
        leaves if that is less (so a long prompt is not refused for a limit its client never set)."""
        cap = self.max_tokens_cap
        if cap is None:
            return
        if params.max_tokens is None:
            params.max_tokens = max(1, min(cap, max_model_len - num_prompt_tokens))
        elif params.max_tokens > cap:
            raise RequestInvalid(
                f"Invalid 'max_tokens': this server allows at most {cap}, but got {params.max_tokens}.",
                "max_tokens",
                code="integer_above_max_value",
            )

    def check(self, num_prompt_tokens: int, num_samples: int, num_pending: int, param: str) -> None:
        """Raise RequestInvalid (400 for a long prompt, 429 when full) before anything is queued."""
        if self.max_prompt_tokens is not None and num_prompt_tokens > self.max_prompt_tokens:
            raise RequestInvalid(
                f"The prompt has {num_prompt_tokens} tokens; this server accepts at most {self.max_prompt_tokens}.",
                param,
                code="prompt_too_long",
            )
        if self.max_pending_requests is not None and num_pending + num_samples > self.max_pending_requests:
            raise RequestInvalid(
                f"The server is at capacity ({num_pending} requests running or queued, limit "
                f"{self.max_pending_requests}); retry shortly.",
                status=429,
                code="too_many_requests",
                error_type="rate_limit_error",
            )

    def check_pooling(self, num_tokens: int, values_per_token: int | None) -> None:
        """Refuse (400, naming the flag) an embedding request whose inputs hold more tokens than
        --max-batch-tokens, or whose per-token output (`values_per_token` values per token, None for one
        vector per input) holds more values than --max-token-embed-values. Why: one request's tokens
        hold the engine for as long as they take, and a per-token output is the request multiplied by
        the model's width (256 x 256 token ids, 0.4 MB, answered with 516 MB of JSON)."""
        if self.max_batch_tokens is not None and num_tokens > self.max_batch_tokens:
            raise RequestInvalid(
                f"Invalid 'input': the inputs hold {num_tokens:,} tokens together; this server pools at most "
                f"{self.max_batch_tokens:,} tokens per request (--max-batch-tokens). Send them in several requests.",
                "input",
                code="too_many_tokens",
            )
        limit = self.max_token_embed_values
        if values_per_token is not None and limit is not None and num_tokens * values_per_token > limit:
            raise RequestInvalid(
                f"Invalid 'input': a per-token output holds {values_per_token} values per token, "
                f"{num_tokens * values_per_token:,} for these {num_tokens:,} tokens; this server returns at most "
                f"{limit:,} values per request (--max-token-embed-values). Send fewer tokens per request, or "
                "use task 'embed' (one vector per input).",
                "input",
                code="too_many_values",
            )
