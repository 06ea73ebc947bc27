"""What a request's output must look like: one structured-output constraint, as it crosses processes.

Shaped like vLLM's `StructuredOutputsParams` (set exactly one of `json`, `json_object`, `regex`,
`choice`, `grammar`). This module imports neither torch nor xgrammar: the API and tokenizer processes
carry the struct inside `SamplingParams` and run the cheap shape checks here. Whether a spec compiles
is the engine's backend's decision (engine_core/structured_output.py), which rejects a bad one before
the request computes anything.
"""

from __future__ import annotations

import json as jsonlib

import msgspec

from pagoda.engine_core.json_limits import depth_message, text_exceeds_depth, value_exceeds_depth
from pagoda.engine_core.validation import ParamError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One output constraint. Unknown fields are refused (never silently ignored).

    - `json`: a JSON Schema, as a dict or as its JSON text; stored as compact JSON text with the
      author's key order (property order decides the order the fields are generated in).
    - `json_object`: any JSON object.
    - `regex`: the whole output matches this regular expression.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: an EBNF grammar (xgrammar's GBNF dialect, `root ::= ...`).
    - `source`: the request field the constraint came from (`response_format`, `guided_json`,
      `tools`, ...); only used to name it in error messages, not part of the cache key.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ParamError (naming `source`) with a message fit for an API error if the shape is wrong."""
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ParamError(
                f"{self.source} must set exactly one of {', '.join(KINDS)}"
                + (f"; got {', '.join(given)}" if given else ""),
                self.source,
            )
        if self.json is not None:
            self.json = _canonical_schema(self.json, self.source)
        if self.regex is not None and not self.regex:
            raise ParamError(f"{self.source}: the regex is empty", self.source)
        if self.grammar is not None and not self.grammar.strip():
            raise ParamError(f"{self.source}: the grammar is empty", self.source)
        if self.choice is not None:
            if not self.choice:
                raise ParamError(f"{self.source}: choice must list at least one string", self.source)
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ParamError(f"{self.source}: every choice must be a non-empty string", self.source)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, spec text): equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, jsonlib.dumps(self.choice, ensure_ascii=False)
        return kind, getattr(self, kind)


def _canonical_schema(schema: str | dict, source: str) -> str:
    """The schema as compact JSON text (key order kept), after checking it is a JSON object nested at
    most MAX_JSON_DEPTH levels deep (checked before anything walks it recursively)."""
    if isinstance(schema, str):
        if text_exceeds_depth(schema):
            raise ParamError(depth_message(source), source)
        try:
            schema = jsonlib.loads(schema)
        except ValueError as exc:
            raise ParamError(f"{source}: the JSON schema is not valid JSON: {exc}", source) from None
    elif value_exceeds_depth(schema):
        raise ParamError(depth_message(source), source)
    if not isinstance(schema, dict):
        raise ParamError(f"{source}: the JSON schema must be a JSON object", source)
    try:
        return jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ParamError(f"{source}: the JSON schema cannot be written as JSON: {exc}", source) from None
