"""POST /v1/embeddings (OpenAI's shape) and POST /pooling (vLLM's): request bodies and responses.

`input` is one text, a list of texts, one input's token ids or a list of them; the tokenizer process
checks the rest (the served model pools, `dimensions`, lengths, --max-batch-inputs) for HTTP and direct
clients alike. Vectors arrive as packed float32 buffers and leave as JSON numbers, or with
`encoding_format: "base64"` as OpenAI encodes them: the little-endian float32 bytes, base64-encoded.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from pagoda.api_proc.openai_schema import ApiError
from pagoda.engine_core import protocol

ENCODING_FORMATS = ("float", "base64")
_json = msgspec.json.Encoder()
_INPUT_TYPES = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None  # (accepted, as OpenAI's; not used)
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None

    def embed_options(self, task: str = "embed") -> dict:
        """`AsyncEngineClient.embed`'s keyword arguments for this body (the input checked here)."""
        if self.encoding_format not in ENCODING_FORMATS:
            raise ApiError(
                400,
                f"Invalid 'encoding_format': expected one of {', '.join(ENCODING_FORMATS)}, got "
                f"{self.encoding_format!r}.",
                "encoding_format",
            )
        return dict(
            inputs=_inputs(self.input),
            dimensions=self.dimensions,
            task=task,
            normalize=self.normalize,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            add_special_tokens=self.add_special_tokens,
        )


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """vLLM's /pooling: `task` "token_embed" (the default: every token's final hidden state, raw) or
    "embed" (the embedding, as /v1/embeddings gives it)."""

    task: str = "token_embed"


def _inputs(value: str | list[Any]) -> str | list:
    if isinstance(value, str):
        return value
    if not value:
        raise ApiError(400, "Invalid 'input': the list of inputs is empty.", "input", "empty_input")
    if all(isinstance(x, str) for x in value):
        return value
    if all(_is_token(x) for x in value):
        return value
    if all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in value):
        return value
    if any(isinstance(x, list) and not x for x in value):
        raise ApiError(400, "Invalid 'input': an input's token ids are empty.", "input", "empty_input")
    raise ApiError(400, f"Invalid type for 'input': expected {_INPUT_TYPES}.", "input", "invalid_type")


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _vectors(pooled: protocol.PooledVectors, encoding_format: str, rows: bool) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(pooled.data).decode("ascii")
    array = pooled.array()
    return array.tolist() if rows else array[0].tolist()


def usage(result: protocol.EmbedResult) -> dict:
    tokens = sum(result.num_prompt_tokens)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def embeddings_response(result: protocol.EmbedResult, model: str, encoding_format: str) -> Iterator[bytes]:
    """OpenAI's embeddings list, as JSON pieces (api_proc/json_reply.py)."""
    data = (
        {"object": "embedding", "index": i, "embedding": _vectors(v, encoding_format, rows=False)}
        for i, v in enumerate(result.outputs)
    )
    return _list_pieces({"object": "list", "model": model}, data, usage(result))


def pooling_response(
    result: protocol.EmbedResult, response_id: str, model: str, req: PoolingRequest
) -> Iterator[bytes]:
    """vLLM's pooling response: per input, its embedding ("embed") or its tokens' vectors ("token_embed"),
    as JSON pieces (api_proc/json_reply.py)."""
    rows = req.task != "embed"
    data = (
        {"index": i, "object": "pooling", "data": _vectors(v, req.encoding_format, rows)}
        for i, v in enumerate(result.outputs)
    )
    head = {"id": response_id, "object": "list", "created": int(time.time()), "model": model}
    return _list_pieces(head, data, usage(result))


def _list_pieces(head: dict, data: Iterator[dict], usage: dict) -> Iterator[bytes]:
    """One JSON object: `head`'s fields, then "data" (each item encoded only when its turn comes, so one
    input's Python floats exist at a time), then "usage"."""
    yield _json.encode(head)[:-1] + b',"data":['
    for index, item in enumerate(data):
        yield (b"," if index else b"") + _json.encode(item)
    yield b'],"usage":' + _json.encode(usage) + b"}"
