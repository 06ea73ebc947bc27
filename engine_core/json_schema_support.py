"""Which JSON Schema keywords the structured-output backend really enforces.

xgrammar 0.2.9 compiles many schemas whose keywords it then does not honour: it accepts the schema and
lets through values the schema forbids. Probing it on this model (a matcher fed a value that breaks
the keyword; tests/engine_core/test_structured_output.py keeps the probes) found these:

- `uniqueItems: true`, `not`, `if`/`then`/`else`, `dependentRequired`/`dependencies`, `maxContains`,
  `minContains` above 1, `additionalItems` other than `true`;
- `multipleOf` anywhere but on `{"type": "integer"}` with an integer divisor;
- `allOf` with more than one subschema (the parts are not intersected);
- `format` values it has no pattern for among the standard ones: idn-email, idn-hostname, iri,
  iri-reference, regex. (Formats outside the standard are annotations, as in every validator.)
- `$ref` to anything but a place in the same schema (`#/...`): nothing fetches a remote schema, so a
  `http://...` reference would constrain nothing.

A schema using any of these is refused with a 400 naming the keyword and where it is, so an output
that "follows the schema" always validates against it. `oneOf` is enforced as `anyOf` (valid
whenever the branches exclude each other, as discriminated unions' do) and is allowed.
"""

from __future__ import annotations

_UNENFORCED = {"uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependencies", "maxContains"}
_UNENFORCED_FORMATS = {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = (
    "additionalProperties",
    "items",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")


def unsupported_feature(schema: object, path: str = "$") -> str | None:
    """A description of the first keyword the backend would not enforce, or None if there is none."""
    if not isinstance(schema, dict):
        return None
    for keyword in _UNENFORCED & schema.keys():
        if keyword == "uniqueItems" and schema[keyword] is False:
            continue
        return f"'{keyword}' at {path}"
    if schema.get("additionalItems", True) is not True:
        return f"'additionalItems' at {path}"
    if schema.get("minContains", 1) not in (0, 1):  # 0 is looser than xgrammar's "contains one": fine
        return f"'minContains' above 1 at {path}"
    if "multipleOf" in schema:
        divisor = schema["multipleOf"]
        if schema.get("type") != "integer" or not isinstance(divisor, int) or isinstance(divisor, bool):
            return f"'multipleOf' at {path} (only an integer divisor on type integer is enforced)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with several subschemas at {path}"
    if schema.get("format") in _UNENFORCED_FORMATS:
        return f"format '{schema['format']}' at {path}"
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        return f"'$ref' to {ref!r} at {path} (only references within the schema, '#/...', are resolved)"
    return _first_in_subschemas(schema, path)


def _first_in_subschemas(schema: dict, path: str) -> str | None:
    for keyword in _SCHEMA_MAPS:
        children = schema.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                found = unsupported_feature(child, f"{path}.{keyword}.{name}")
                if found:
                    return found
    for keyword in _SCHEMA_VALUES:
        found = unsupported_feature(schema.get(keyword), f"{path}.{keyword}")
        if found:
            return found
    for keyword in _SCHEMA_LISTS:
        children = schema.get(keyword)
        if isinstance(children, list):
            for index, child in enumerate(children):
                found = unsupported_feature(child, f"{path}.{keyword}[{index}]")
                if found:
                    return found
    return None
