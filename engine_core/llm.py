"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import fields
from typing import cast

from tqdm import tqdm

from pagoda.engine_core.config import EngineConfig, parse_size
from pagoda.engine_core.engine import create_engine
from pagoda.engine_core.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from pagoda.engine_core.pooling import inputs as pooling_inputs
from pagoda.engine_core.pooling.engine import PoolingEngineCore
from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.protocol import FinishReason, PromptLogprobs, TokenLogprobs
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.tokenizer import encode_chat, load_tokenizer

PromptType = str | dict

_CONFIG_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM:
    """An engine on one model, run in this process.

    `LLM()` uses the default model (SmolLM2-135M-Instruct, prepared on first use); `model=` takes any
    Hugging Face model directory or hub id. Keyword arguments are `EngineConfig` fields
    (`dtype`, `block_size`, `kv_cache_memory` ("2GiB"), `max_num_batched_tokens`, `max_num_seqs`, ...).
    `tensor_parallel_size=T` and `pipeline_parallel_size=P` split the model over T x P processes (this
    one and the workers it starts; `enable_expert_parallel=True`: a mixture of experts' experts whole per
    rank); `close()`, or leaving a `with LLM(...) as llm:` block, stops them.
    An embedding model (an encoder such as all-MiniLM-L6-v2, or any model with `runner="pooling"`)
    answers `embed` instead of `generate`.
    """

    def __init__(self, model: str | None = None, **engine_args):
        unknown = set(engine_args) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        if engine_args.get("kv_cache_memory") is not None:
            engine_args["kv_cache_memory"] = parse_size(engine_args["kv_cache_memory"])
        self.engine = create_engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs (decoded once each)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Prompts are strings or `{"prompt_token_ids": [...]}` dicts (either may be a dict with a
        "prompt" and a "cache_salt"); outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        return self._run(encoded, params_list, use_tqdm, salts)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (strings or `{"prompt_token_ids": [...]}` dicts), in input order; an
        embedding model only. `dimensions`: a Matryoshka model's shorter embeddings;
        `truncate_prompt_tokens`: keep at most that many tokens of each prompt (-1: the model's maximum)
        instead of refusing a longer one."""
        engine = self.engine
        if not isinstance(engine, PoolingEngineCore):
            raise ValueError("this model generates text: embed() needs an embedding model (runner='pooling')")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        keep = pooling_inputs.truncation(truncate_prompt_tokens, engine.max_model_len)
        token_ids = [
            pooling_inputs.keep_last(self._encode(p)[1], keep)
            if not isinstance(p, str)
            else pooling_inputs.tokenize(self.tokenizer, [p], True, keep)[0]
            for p in prompts
        ]
        pooling_inputs.check_lengths(token_ids, engine.max_model_len, "prompt")
        params = PoolingParams(dimensions=dimensions)
        ids = [f"{next(self._ids)}" for _ in token_ids]
        vectors: dict[str, list[float]] = {}
        bar = tqdm(total=len(ids), desc="Embedding", disable=not use_tqdm or len(ids) < 8)
        try:
            for request_id, tokens in zip(ids, token_ids, strict=True):
                engine.add_request(request_id, tokens, pooling=params)
            while len(vectors) < len(ids):
                for out in engine.step():
                    assert out.pooled is not None  # (every delta of a pooling engine has its vector)
                    vectors[out.request_id] = out.pooled.array()[0].tolist()
                    bar.update(1)
        finally:  # an error or an interrupt leaves nothing of this call queued
            bar.close()
            for request_id in set(ids) - vectors.keys():
                engine.abort_request(request_id)
        return [
            EmbeddingRequestOutput(request_id, tokens, EmbeddingOutput(vectors[request_id]))
            for request_id, tokens in zip(ids, token_ids, strict=True)
        ]

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (also done when the LLM is collected, or
        at exit); the LLM cannot generate afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the number of cached blocks dropped."""
        return self.engine.reset_prefix_cache()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, through the model's chat template."""
        # (cast: mypy cannot narrow a union of list types by the type of an element)
        conversations = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict) else messages)
        encoded = [
            (
                None,
                encode_chat(
                    self.tokenizer,
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs,
                ),
            )
            for conv in conversations
        ]
        return self._run(encoded, self._params_per_prompt(sampling_params, len(encoded)), use_tqdm)

    def _params_per_prompt(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return list(params)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError("a prompt is a string or a dict with 'prompt_token_ids'")

    def _run(self, encoded, params_list, use_tqdm: bool, salts=None) -> list[RequestOutput]:
        slots: dict[str, tuple[int, int]] = {}
        try:
            for index, ((_, token_ids), params) in enumerate(zip(encoded, params_list, strict=True)):
                for sample in range(params.n):
                    child = params.for_sample(sample)  # n > 1 becomes n sibling requests
                    request_id = f"{next(self._ids)}"
                    self.engine.add_request(request_id, token_ids, child, salts[index] if salts else None)
                    slots[request_id] = (index, sample)
        except ValueError as exc:  # one bad prompt rejects the whole call; nothing stays queued
            for request_id in slots:
                self.engine.abort_request(request_id)
            raise ValueError(f"prompt {index}: {exc}") from exc
        tokens: dict[str, list[int]] = {rid: [] for rid in slots}
        logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in slots}
        reasons: dict[str, FinishReason] = {}
        cached: dict[str, int] = {}
        prompt_logprobs: dict[str, PromptLogprobs] = {}
        bar = tqdm(total=len(slots), desc="Generating", disable=not use_tqdm or len(slots) < 8)
        try:
            while len(reasons) < len(slots):
                for out in self.engine.step():
                    tokens[out.request_id].extend(out.new_token_ids)
                    cached[out.request_id] = out.num_cached_tokens
                    logprobs[out.request_id].extend(out.new_logprobs)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finish_reason is not None:
                        reasons[out.request_id] = out.finish_reason
                        bar.update(1)
                for ended in self.engine.take_ended():  # a structured-output spec, or a failed request
                    raise ValueError(f"prompt {slots[ended.request_id][0]}: {ended.message}")
        finally:  # interrupted (Ctrl-C, an engine error): leave nothing of this call queued
            bar.close()
            for request_id in slots.keys() - reasons.keys():
                self.engine.abort_request(request_id)
        results = [
            RequestOutput(str(i), prompt, ids, [])
            for i, ((prompt, ids), params) in enumerate(zip(encoded, params_list, strict=True))
        ]
        for rid, (index, sample) in slots.items():  # in (prompt, sample) order, as they were added
            params = params_list[index]
            if sample == 0:
                results[index].num_cached_tokens = cached.get(rid, 0)
                if rid in prompt_logprobs:  # (only sample 0 computes them: SamplingParams.for_sample)
                    results[index].prompt_logprobs = prompt_logprobs[rid].by_position(
                        lambda token_id, logprob, rank: Logprob(logprob, rank, self._token_text(token_id))
                    )
            results[index].outputs.append(
                CompletionOutput(
                    index=sample,
                    finish_reason=reasons[rid],
                    token_ids=tokens[rid],
                    text=self.tokenizer.decode(tokens[rid], skip_special_tokens=params.skip_special_tokens),
                    **self._logprob_fields(logprobs[rid], params),
                )
            )
        return results

    def _logprob_fields(self, entries: list[TokenLogprobs], params: SamplingParams) -> dict:
        if params.logprobs is None:
            return {}
        per_token = []
        cumulative = 0.0
        for packed in entries:
            token = packed.sampled_and_top()
            cumulative += token.logprob
            entry = {
                tid: Logprob(lp, rank + 1, self._token_text(tid))
                for rank, (tid, lp) in enumerate(zip(token.top_ids, token.top_logprobs, strict=True))
            }
            if token.token_id not in entry:
                entry[token.token_id] = Logprob(token.logprob, None, self._token_text(token.token_id))
            per_token.append(entry)
        return {"logprobs": per_token, "cumulative_logprob": cumulative}

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text
