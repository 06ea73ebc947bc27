"""Pooling inputs to token ids, checked against the model's input length (no torch: the tokenizer
process and the offline API share this)."""

from __future__ import annotations

from pagoda.engine_core.validation import ParamError


def truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many tokens to keep of each input (vLLM's `truncate_prompt_tokens`; -1 = the model's maximum),
    or None: inputs are not truncated, and a long one is refused."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if not 1 <= truncate_prompt_tokens <= max_model_len:
        raise ParamError(
            f"Invalid 'truncate_prompt_tokens': expected -1 or a value in [1, {max_model_len}] (this model's "
            f"maximum input length), got {truncate_prompt_tokens}.",
            "truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def tokenize(tokenizer, texts: list[str], add_special_tokens: bool, keep: int | None) -> list[list[int]]:
    """Each text's token ids, in one batched call; with `keep`, at most that many (the tokenizer's own
    truncation: its side, special tokens kept)."""
    if keep is None:
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return tokenizer(texts, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)["input_ids"]


def keep_last(ids: list[int], keep: int | None) -> list[int]:
    """Token-id inputs keep their last `keep` tokens (as vLLM truncates them)."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def check_not_empty(inputs: list[list[int]], param: str = "input") -> None:
    """ParamError for the first input without a token (e.g. an empty text with add_special_tokens false)."""
    for index, ids in enumerate(inputs):
        if not ids:
            where = f"{param}[{index}]" if len(inputs) > 1 else param
            raise ParamError(f"Invalid '{where}': the input is empty (it has no tokens).", param)


def check_lengths(inputs: list[list[int]], max_model_len: int, param: str = "input") -> None:
    """ParamError for the first input that is empty (check_not_empty) or longer than the model's maximum."""
    check_not_empty(inputs, param)
    for index, ids in enumerate(inputs):
        if len(ids) > max_model_len:
            where = f"{param}[{index}]" if len(inputs) > 1 else param
            raise ParamError(
                f"Invalid '{where}': the input has {len(ids)} tokens, but this model's maximum input length is "
                f"{max_model_len} tokens. Shorten it, or set truncate_prompt_tokens to truncate it.",
                param,
            )
