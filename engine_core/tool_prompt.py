"""Putting `tools` into the prompt, for chat templates that do not render them.

A template that knows tools (Qwen's, Llama 3.1's, ...) gets them through `apply_chat_template(...,
tools=...)` and is used as is. SmolLM2's template ignores them; SmolLM2 was trained on function
calling with the tool list in the system message and calls written as
`<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`. For such templates the tools go into
the system message in that format (appended to the user's own system message, if any), earlier
assistant tool calls are written back in it, and tool results become user turns inside
`<tool_response>` tags. Whether a template renders tools is found once per template by rendering a
probe conversation with and without a tool.
"""

from __future__ import annotations

import json
from typing import Any

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_7f3a", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_PROBE_MESSAGES = [{"role": "user", "content": "hi"}]
_renders_tools: dict[str, bool] = {}  # chat template text -> whether it renders `tools`


def template_renders_tools(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    if template not in _renders_tools:
        try:
            with_tool = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], tokenize=False)
            without = tokenizer.apply_chat_template(_PROBE_MESSAGES, tokenize=False)
            _renders_tools[template] = "probe_tool_7f3a" in with_tool and with_tool != without
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            _renders_tools[template] = False
    return _renders_tools[template]


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    functions = [tool.get("function", tool) for tool in tools]
    return (
        "You can call functions to answer. The functions available are described here as JSON:\n"
        f"<tools>{json.dumps(functions, ensure_ascii=False)}</tools>\n"
        "To call functions, reply with the calls alone, in exactly this form:\n"
        '<tool_call>[{"name": "function_name", "arguments": {"argument_name": "value"}}]</tool_call>\n'
        "Use only the functions listed, with arguments of the types their parameters give. If no "
        "function fits the request, say so in a normal reply."
    )


def messages_with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tool prompt in the system message, in the format SmolLM2 was trained on."""
    out = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            out.append({"role": "assistant", "content": _calls_text(message["tool_calls"])})
        elif role == "tool":
            result = message.get("content") or ""
            out.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
        else:
            out.append(message)
    prompt = tool_system_prompt(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _calls_text(tool_calls: list[dict[str, Any]]) -> str:
    calls = []
    for call in tool_calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # written back as the string it was
        calls.append({"name": function.get("name"), "arguments": arguments})
    return f"<tool_call>{json.dumps(calls, ensure_ascii=False)}</tool_call>"
