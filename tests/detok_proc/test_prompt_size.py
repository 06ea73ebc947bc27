"""The checks that refuse long prompts before tokenizing them all: sound (they never refuse a prompt
that fits) and cheap (a refused text is never tokenized whole)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.detok_proc.prompt_size import (
    PROBE_BYTES_PER_TOKEN,
    PromptTooLong,
    check_length_bound,
    encode_within,
    longest_token_bytes,
    prompt_bytes,
    text_bytes,
)
from pagoda.engine_core import protocol
from pagoda.engine_core.sampling_params import SamplingParams

# Control characters excepted: this model's tokenizer drops some of them (a text of them encodes to
# nothing), which is the one way around the bound, and no use to anyone (prompt_size.py).
_PRINTABLE = st.characters(blacklist_categories=("Cc", "Cs"))
TEXTS = (
    st.text(_PRINTABLE, max_size=300)
    | st.text(alphabet=" \n\t#=-", max_size=300)
    | st.lists(st.sampled_from(["the", " ", "\n", "########", "é", "日本", "🙂", "\u0301", "#" * 80]), max_size=80).map(
        "".join
    )
)


@settings(max_examples=200, deadline=None)
@given(TEXTS)
def test_no_text_needs_fewer_tokens_than_its_bytes_over_the_longest_token(tokenizer, text):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert text_bytes(text) <= len(tokens) * longest_token_bytes(tokenizer)
    check_length_bound(text_bytes(text), max(len(tokens), 1), longest_token_bytes(tokenizer))  # never refuses


class RecordingTokenizer:
    """The real tokenizer, noting the length of every text it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)


@settings(max_examples=150, deadline=None)
@given(TEXTS, st.integers(1, 30))
def test_the_probe_refuses_only_what_cannot_fit_and_never_tokenizes_it_whole(tokenizer, text, limit):
    recording = RecordingTokenizer(tokenizer)
    full = len(tokenizer.encode(text, add_special_tokens=False))
    try:
        ids = encode_within(recording, text, limit, add_special_tokens=False)
    except PromptTooLong:
        assert full > limit  # sound: refused only when it really does not fit
        assert recording.lengths == [min(len(text), limit * PROBE_BYTES_PER_TOKEN)]  # the head, once
    else:
        assert len(ids) == full


def test_a_long_ordinary_text_is_refused_from_its_head():
    class Words:  # ~1 token per 4 bytes, like English: a 2 MB text is over any small limit
        def encode(self, text, **kwargs):
            self.seen = len(text)
            return list(range(len(text) // 4))

    words = Words()
    with pytest.raises(PromptTooLong, match="more than 200 tokens"):
        encode_within(words, "word " * 400_000, 100, add_special_tokens=False)
    assert words.seen == 100 * PROBE_BYTES_PER_TOKEN


def test_prompt_bytes_counts_every_string_a_template_may_render():
    params = SamplingParams()
    assert prompt_bytes(protocol.GenerateRequest(request_id="a", params=params, prompt="x" * 10)) == 10
    assert prompt_bytes(protocol.GenerateRequest(request_id="a", params=params, prompt="日本")) == 6  # UTF-8
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ]
    chat = protocol.ChatOptions(tools=[{"type": "function"}], chat_template_kwargs={"k": "vv"})
    request = protocol.GenerateRequest(request_id="b", params=params, messages=messages, chat=chat)
    expected = sum(
        map(
            len,
            [
                "role",
                "user",
                "content",
                "hello",
                "role",
                "assistant",
                "tool_calls",
                "function",
                "name",
                "f",
                "arguments",
                "{}",
                "type",
                "function",
                "k",
                "vv",
            ],
        )
    )
    assert prompt_bytes(request) == expected
