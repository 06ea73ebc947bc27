"""Tools in the prompt: through the chat template when it renders them, else in the system message."""

from __future__ import annotations

import copy

from pagoda.engine_core.tokenizer import render_chat
from pagoda.engine_core.tool_prompt import template_renders_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "Weather forecast",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_smollm2_template_ignores_tools_so_they_go_into_the_system_message(tokenizer):
    assert not template_renders_tools(tokenizer)
    text = render_chat(tokenizer, ASK, tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and '"name": "get_forecast"' in system
    assert "<tool_call>[" in system and "Weather in Paris?" in text
    assert render_chat(tokenizer, ASK) != text and "get_forecast" not in render_chat(tokenizer, ASK)

    own_system = render_chat(tokenizer, [{"role": "system", "content": "Be brief."}] + ASK, tools=TOOLS)
    assert own_system.startswith("<|im_start|>system\nBe brief.\n\n") and own_system.count("<|im_start|>system") == 1


def test_tool_history_is_written_in_the_trained_format(tokenizer):
    history = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_forecast", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render_chat(tokenizer, history, tools=TOOLS)
    call = '<tool_call>[{"name": "get_forecast", "arguments": {"city": "Paris"}}]</tool_call>'
    assert f"<|im_start|>assistant\n{call}" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text


def test_a_template_that_renders_tools_gets_them(tokenizer):
    with_tools = copy.deepcopy(tokenizer)
    with_tools.chat_template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    assert template_renders_tools(with_tools)
    text = render_chat(with_tools, ASK, tools=TOOLS, add_generation_prompt=False)
    assert text.startswith("TOOLS:[") and "get_forecast" in text and text.endswith("user: Weather in Paris?\n")
