"""The bound that refuses long prompts before tokenizing: sound (never refuses a prompt that fits)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from detok_proc.prompt_size import longest_token_chars, prompt_chars
from engine_core import protocol
from engine_core.sampling_params import SamplingParams


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300) | st.text(alphabet=" \n\t#=-", max_size=300)
       | st.lists(st.sampled_from(["the", " ", "\n", "########", "é", "日本", "🙂", "\u0301"]), max_size=80).map("".join))
def test_no_text_needs_fewer_tokens_than_its_length_over_the_longest_token(tokenizer, text):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(text) <= len(tokens) * longest_token_chars(tokenizer)


def test_prompt_chars_counts_every_string_a_template_may_render():
    params = SamplingParams()
    assert prompt_chars(protocol.GenerateRequest(request_id="a", params=params, prompt="x" * 10)) == 10
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]
    chat = protocol.ChatOptions(tools=[{"type": "function"}], chat_template_kwargs={"k": "vv"})
    request = protocol.GenerateRequest(request_id="b", params=params, messages=messages, chat=chat)
    expected = sum(map(len, ["role", "user", "content", "hello", "role", "assistant", "tool_calls", "function",
                             "name", "f", "arguments", "{}", "type", "function", "k", "vv"]))
    assert prompt_chars(request) == expected
