"""Per-request sampling parameters, shaped like vLLM's so its users can switch.

A msgspec Struct so the same object crosses process boundaries unchanged.

Every float parameter is bounded to a range where the sampler's float32 arithmetic stays finite
(NaN fails every range check): logits divided by a temperature of 1e-45, or by a repetition penalty
of 1e-45, overflow float32, and softmax then gives NaN. A temperature below `GREEDY_BELOW` (vLLM's
threshold) is taken as greedy: a 1e-50 would otherwise round to 0.0 in float32 and sample.
"""

from __future__ import annotations

import msgspec

from pagoda.engine_core.structured_params import StructuredOutputsParams
from pagoda.engine_core.validation import TOKEN_ID_LIMIT, ParamError, check_token_ids

# A temperature below this is greedy decoding (vLLM's threshold, 1e-5): at such a temperature the most
# likely token wins anyway unless two logits tie to within ~1e-4.
GREEDY_BELOW = 1e-5
# The largest temperature: far beyond it every token is equally likely, and float32 is nowhere near overflow.
MAX_TEMPERATURE = 1e4
# Repetition penalty divides (or multiplies) logits: within [1/100, 100] a logit of any sane size stays finite.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the model's context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    # Per prompt token (but the first): its logprob and rank, and this many top logprobs besides (vLLM's).
    # A request asking for them computes its whole prompt: cached prefix blocks have no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = {}  # token id -> value added to its logit before sampling
    # Constrain the output (JSON schema, regex, choice, grammar): tokens that would break it are masked
    # at the logits. The grammar then decides when the output may end, so min_tokens does not hold
    # EOS back, and a complete output ends the request even with ignore_eos.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if 0.0 <= self.temperature < GREEDY_BELOW:  # (also turns -0.0 into 0.0)
            self.temperature = 0.0
        self.validate()

    def validate(self) -> None:
        """Raise ParamError (a ValueError naming the field) if a field is out of range."""
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (
                0.0 <= self.temperature <= MAX_TEMPERATURE,
                "temperature",
                f"must be in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_BELOW:g} it means greedy)",
            ),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0 <= self.top_k < TOKEN_ID_LIMIT, "top_k", "must be -1 (disabled) or a positive integer below 2**31"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (
                REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
                "repetition_penalty",
                "must be in [{:g}, {:g}]".format(*REPETITION_PENALTY_RANGE),
            ),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (
                self.max_tokens is None or 1 <= self.max_tokens < TOKEN_ID_LIMIT,
                "max_tokens",
                "must be at least 1 and below 2**31",
            ),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
            ),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
            (
                all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "values must be in [-100, 100]",
            ),
        ]
        for ok, field, rule in checks:
            if not ok:
                raise ParamError(f"{field} {rule}", field)
        check_token_ids(self.stop_token_ids, None, "stop_token_ids")
        check_token_ids(self.logit_bias, None, "logit_bias")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of an n > 1 request, which runs as its own engine request:
        n=1, and a seeded request's i-th sample uses seed + i (wrapping within the seed range), so
        the samples differ from each other and each is reproducible. Prompt logprobs belong to the
        prompt, not to a sample: only sample 0 computes them, so the others can still take its
        prompt's blocks from the prefix cache."""
        if self.n == 1:
            return self
        seed = None if self.seed is None else (self.seed + index) % 2**63
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return msgspec.structs.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
