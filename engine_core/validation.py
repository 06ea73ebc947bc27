"""Input checks shared by every layer that accepts requests (the HTTP API, the tokenizer process, the
offline `LLM` and the engine itself), so each rule and its message exist once.

`ParamError` is a ValueError that names the request field at fault: every layer turns it into
OpenAI's 400 with that `param`, so no refusal goes out with `param: null` when a field is to blame.
"""

from __future__ import annotations

from collections.abc import Iterable

# Token ids cross processes as int32: nothing at or above this can be a token id anywhere.
TOKEN_ID_LIMIT = 2**31


class ParamError(ValueError):
    """A request value out of range; `param` names the field (as the OpenAI API spells it)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def param_of(exc: BaseException) -> str | None:
    """The field a ValueError blames, if it is a ParamError."""
    return getattr(exc, "param", None)


def is_token_id(value: object, vocab_size: int = TOKEN_ID_LIMIT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def check_token_ids(token_ids: Iterable[int], vocab_size: int | None, param: str) -> None:
    """Raise ParamError unless every id is an integer in [0, vocab_size) (or below 2**31 when the
    vocabulary is not known at this layer)."""
    upper = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    try:  # min/max run in C: a 100k-token prompt costs microseconds, not a Python loop per id
        in_range = not ids or (min(ids) >= 0 and max(ids) < upper)
    except TypeError:  # not all numbers
        in_range = False
    if not (in_range and all(type(t) is int for t in ids)):  # bools and floats are not token ids
        raise ParamError(f"Invalid '{param}': token ids must be integers in [0, {upper}).", param)
