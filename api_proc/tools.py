"""Tool calling on /v1/chat/completions: `tools` + `tool_choice` checked and turned into a plan.

- `none` (or no tools): the tools are not shown to the model; plain chat.
- `auto` (the default with tools): the tools are rendered into the prompt (engine_core/tool_prompt.py)
  and the output is free; if it is a tool call in the model's format, `<tool_call>[{"name": ...,
  "arguments": {...}}]</tool_call>`, it is returned as `tool_calls`, otherwise as content.
- `required`: the output is constrained by a JSON schema to an array of calls, each
  `{"name": <one of the tools>, "arguments": <that tool's parameters schema>}` (one call at most
  with `parallel_tool_calls: false`), so the arguments always parse and match.
- a named function: the output is constrained to that function's parameters schema, i.e. it *is*
  the arguments.

Forced calls are raw JSON without the `<tool_call>` tags (as vLLM does it): the tags would only cost
tokens the constraint already pins down. Parsing the output back into OpenAI's `tool_calls`, streamed
or not, is api_proc/tool_parsing.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagoda.api_proc.openai_schema import ApiError
from pagoda.engine_core.structured_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    functions: list[dict[str, Any]]  # each {"name", "description"?, "parameters"}
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls: more than one call allowed

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def constraint(self) -> StructuredOutputsParams | None:
        """The JSON schema that forces the call(s): None for `auto`."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.named), source="tools")
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": _rebase_refs(f["parameters"], f"#/items/anyOf/{i}/properties/arguments"),
                    },
                    "required": ["name", "arguments"],
                }
                for i, f in enumerate(self.functions)
            ]
            schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, source="tools")
        return None

    def _parameters(self, name: str) -> dict[str, Any]:
        return next(f["parameters"] for f in self.functions if f["name"] == name)


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool = True
) -> ToolPlan | None:
    """Check `tools` and `tool_choice` (OpenAI's shapes; any mistake is a 400) and plan the request;
    None when no tool can be called."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools' to choose from.", "tool_choice")
        return None
    functions = [_function(i, tool) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "Invalid 'tools': function names must be unique.", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return ToolPlan(choice, functions, parallel=parallel_tool_calls)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ApiError(400, f"Invalid 'tool_choice': no tool named {name!r} in 'tools'.", "tool_choice")
        return ToolPlan("named", functions, named=name, parallel=parallel_tool_calls)
    raise ApiError(
        400,
        "Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}.',
        "tool_choice",
    )


def _function(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f'Invalid \'{where}\': expected {{"type": "function", "function": {{...}}}}.', "tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"Invalid '{where}.function.name': letters, digits, '_' and '-', at most 64.", "tools")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:
        parameters = _EMPTY_PARAMETERS  # a call's arguments are always a JSON object
    if not isinstance(parameters, dict):
        raise ApiError(400, f"Invalid '{where}.function.parameters': expected a JSON Schema object.", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"Invalid '{where}.function.description': expected a string.", "tools")
    out = {"name": name, "parameters": parameters}
    if description:
        out["description"] = description
    return out


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` moved under `base` in a bigger schema: its local `$ref`s ("#/...") point into it."""
    if isinstance(schema, dict):
        return {
            key: (
                base + value[1:]
                if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else _rebase_refs(value, base)
            )
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    return schema
