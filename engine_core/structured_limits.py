"""How large a structured-output constraint may be: the server's size limits and their check.

Grammar compilation costs more than linearly in a spec's size (measured with xgrammar 0.2.9 on 2
cores: a JSON schema of 500 string properties compiled in 0.5 s, 1,000 in 3.8 s, 2,000 in 38 s; a 1 MB
grammar literal or one 1 MB choice took ~40 s), so an oversized spec is refused before anything
compiles it. The check runs twice: in the HTTP worker (`ApiServer._limited`), so a huge spec never
leaves it, and in the engine (`StructuredOutputManager.submit`), which every client reaches (the
direct client, the offline `LLM`). Neither imports torch.

What the limits cannot see (a small schema whose compile still explodes, e.g. deeply nested `anyOf`)
is bounded by the compile time limit instead (engine_core/grammar_pool.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.engine_core.structured_params import StructuredOutputsParams
from pagoda.engine_core.validation import ParamError

# The flags that set each limit (engine_core/config.py), named in every refusal.
MAX_BYTES_FLAG = "--structured-output-max-bytes"
MAX_PROPERTIES_FLAG = "--structured-output-max-properties"
MAX_CHOICES_FLAG = "--structured-output-max-choices"
COMPILE_TIMEOUT_FLAG = "--structured-output-compile-timeout"

# Keys whose values are data, not subschemas: a "properties" key inside them is no schema's.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keys whose values map names to subschemas (a subschema may be named "properties").
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


@dataclass(frozen=True)
class StructuredOutputLimits:
    """The largest constraint this server compiles; None = no limit. Defaults: OpenAI allows schemas
    of up to 5,000 properties and 120,000 characters of names and values; here a 1,000-property schema
    already takes seconds to compile (see the module docstring), so the defaults are lower."""

    max_bytes: int | None = 128 * 1024  # the spec's text (schema JSON, regex, grammar, choices as JSON)
    max_properties: int | None = 1000  # object properties in a JSON schema, every level counted
    max_choices: int | None = 5000  # strings in a choice (5,000 short ones compiled in 0.23 s here)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise ParamError (naming `spec.source`, the limit and its flag) if `spec` exceeds a limit."""
        kind, text = spec.cache_key()
        size = len(text.encode())
        if self.max_bytes is not None and size > self.max_bytes:
            self._refuse(spec, f"is {size} bytes long", self.max_bytes, "bytes", MAX_BYTES_FLAG)
        if kind == "choice" and self.max_choices is not None and len(spec.choice or ()) > self.max_choices:
            self._refuse(spec, f"lists {len(spec.choice or ())} choices", self.max_choices, "", MAX_CHOICES_FLAG)
        if kind == "json" and self.max_properties is not None:
            count = count_properties(json.loads(text))
            if count > self.max_properties:
                self._refuse(spec, f"has {count} properties", self.max_properties, "", MAX_PROPERTIES_FLAG)

    @staticmethod
    def _refuse(spec: StructuredOutputsParams, what: str, limit: int, unit: str, flag: str) -> None:
        noun = {"json": "JSON schema", "choice": "choice", "regex": "regex", "grammar": "grammar"}.get(
            spec.kind, "constraint"
        )
        raise ParamError(
            f"Invalid '{spec.source}': the {noun} {what}; this server allows at most {limit}"
            f"{' ' + unit if unit else ''} ({flag}).",
            spec.source,
        )


def count_properties(schema: object) -> int:
    """Object properties declared anywhere in a JSON schema (every `properties` map, at every level)."""
    if isinstance(schema, list):
        return sum(count_properties(item) for item in schema)
    if not isinstance(schema, dict):
        return 0
    total = len(schema["properties"]) if isinstance(schema.get("properties"), dict) else 0
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            total += sum(count_properties(child) for child in value.values())
        else:
            total += count_properties(value)
    return total
