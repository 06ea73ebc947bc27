"""The request fields that constrain the output, turned into one `StructuredOutputsParams`.

Three spellings reach the same constraint, on both /v1/completions and /v1/chat/completions:
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM's older extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- vLLM's current `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.

At most one may be given, and none together with callable tools (a forced `tool_choice` is a
constraint of its own, and `auto` leaves the output free). Nothing is silently ignored: an unknown
`response_format` type, an option this server does not implement (`guided_whitespace_pattern`,
`structured_outputs.disable_any_whitespace`, ...) or two constraints at once are a 400. A spec over the
server's size limits is a 400 here (`check_constraint_size`), before it leaves this process; whether
the spec compiles is checked by the engine, before any compute.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagoda.api_proc.openai_schema import ApiError
from pagoda.api_proc.tools import ToolPlan
from pagoda.engine_core.structured_limits import StructuredOutputLimits
from pagoda.engine_core.structured_params import StructuredOutputsParams
from pagoda.engine_core.validation import ParamError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_BACKENDS = (None, "auto", "xgrammar")


def structured_outputs_of(request, tools: ToolPlan | None = None) -> StructuredOutputsParams | None:
    """The one constraint `request` (a Completion/ChatCompletionRequest) asks for, or None. `tools`:
    the request's tool plan; a forced tool call is a constraint of its own."""
    if request.guided_whitespace_pattern is not None:
        raise ApiError(
            400,
            "'guided_whitespace_pattern' is not supported: JSON output is always compact "
            "(', ' and ': ' separators, no newlines).",
            "guided_whitespace_pattern",
        )
    if request.guided_decoding_backend not in _BACKENDS:
        raise ApiError(
            400,
            f"Invalid 'guided_decoding_backend': this server uses xgrammar, not {request.guided_decoding_backend!r}.",
            "guided_decoding_backend",
        )
    found: list[StructuredOutputsParams] = []
    if request.response_format is not None:
        found += _from_response_format(request.response_format)
    for field, kind in _GUIDED.items():
        value = getattr(request, field)
        if value is not None:
            found.append(_build(field, {kind: value}))
    if request.structured_outputs is not None:
        found.append(_build("structured_outputs", request.structured_outputs))
    if tools is not None:
        if found:  # under `auto` the output would have to be both free and constrained
            raise ApiError(
                400,
                f"'{found[0].source}' cannot be combined with 'tools' unless tool_choice is 'none'.",
                found[0].source,
            )
        return tools.constraint()
    if len(found) > 1:
        names = ", ".join(f"'{c.source}'" for c in found)
        raise ApiError(400, f"Only one output constraint may be given; this request has {names}.", found[1].source)
    return found[0] if found else None


def check_constraint_size(spec: StructuredOutputsParams, limits: StructuredOutputLimits) -> None:
    """The 400 (naming the field, the limit and its flag) for a spec over the server's size limits."""
    try:
        limits.check(spec)
    except ParamError as exc:
        raise ApiError(400, str(exc), exc.param, "constraint_too_large") from None


def _from_response_format(response_format: dict[str, Any]) -> list[StructuredOutputsParams]:
    kind = response_format.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [_build("response_format", {"json_object": True})]
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(
                400,
                "'response_format' of type json_schema needs 'json_schema': {\"name\": ..., "
                '"schema": {...}} with the schema as a JSON object.',
                "response_format",
            )
        return [_build("response_format", {"json": spec["schema"]})]
    raise ApiError(
        400,
        f"Invalid 'response_format.type': {kind!r}; expected 'text', 'json_object' or 'json_schema'.",
        "response_format",
    )


def _build(source: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    """A StructuredOutputsParams from request JSON, or the 400 naming `source`."""
    if "source" in fields:
        raise ApiError(400, f"Invalid '{source}': unknown field 'source'.", source)
    try:
        return msgspec.convert({**fields, "source": source}, StructuredOutputsParams)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if "unknown field" in message:
            message = f"Invalid '{source}': {message.split(' - at')[0]} (not supported by this server)."
        elif not message.startswith(source):
            message = f"Invalid '{source}': {message}"
        raise ApiError(400, message, source) from None
