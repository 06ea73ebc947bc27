"""Incremental detokenization with the real SmolLM2 tokenizer: UTF-8 safety and stop strings."""

from __future__ import annotations

import pytest

from pagoda.detok_proc.incremental import IncrementalDetokenizer

TEXTS = [
    "Crème brûlée, naïve café — déjà vu.",
    "東京は日本の首都です。北京是中国的首都。",
    "Party time 🎉🎊 with 👩‍👩‍👧 family and 🇫🇷 flags!",
    "Mixed: αβγ, Привет, مرحبا, and plain ASCII.",
]


def _stream(tokenizer, output_ids, prompt_ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [detok.add([t]) for t in output_ids]
    return detok, deltas, deltas + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_one_shot_decode_and_never_breaks_utf8(tokenizer, text):
    prompt = tokenizer.encode("Say something:")
    output = tokenizer.encode(" " + text)
    _, deltas, everything = _stream(tokenizer, output, prompt)
    assert "".join(everything) == tokenizer.decode(output, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)
    if any(ord(c) > 0xFFFF for c in text) or "東" in text:  # characters split over byte-level tokens
        assert "" in deltas, "a partial character must be held back, not sent"


def test_special_tokens_skipped_or_kept(tokenizer):
    output = tokenizer.encode("Paris.") + [2]  # <|im_end|>
    assert "".join(_stream(tokenizer, output, [1])[2]) == "Paris."
    kept = "".join(_stream(tokenizer, output, [1], skip_special_tokens=False)[2])
    assert kept == "Paris.<|im_end|>"


def test_stop_string_split_over_tokens_is_caught_and_never_leaked(tokenizer):
    output = tokenizer.encode("The answer is 42. END OF ANSWER and more text")
    stop = "END OF ANSWER"
    assert len([t for t in output if tokenizer.decode([t]).strip() in ("END", "OF", "ANSWER")]) >= 2
    detok, deltas, everything = _stream(tokenizer, output, [1], stop=[stop])
    assert detok.stopped and detok.stop_reason == stop
    assert "".join(everything) == "The answer is 42. "
    assert not any("END" in d for d in deltas)
    _, _, inclusive = _stream(tokenizer, output, [1], stop=[stop], include_stop_str_in_output=True)
    assert "".join(inclusive) == "The answer is 42. END OF ANSWER"


def test_text_that_only_looks_like_a_stop_start_is_released(tokenizer):
    output = tokenizer.encode("wait... waiting done")
    detok, deltas, everything = _stream(tokenizer, output, [1], stop=["waitX"])
    assert not detok.stopped and "".join(everything) == "wait... waiting done"
    assert "".join(deltas) == "wait... waiting done"  # nothing held once " done" decides it


def test_earliest_of_several_stop_strings_wins(tokenizer):
    output = tokenizer.encode("alpha beta gamma delta")
    detok, _, everything = _stream(tokenizer, output, [1], stop=["delta", "beta"])
    assert detok.stop_reason == "beta" and "".join(everything) == "alpha "


def test_a_decoder_error_restarts_the_stream_instead_of_failing(tokenizer):
    ids = tokenizer.encode(" one two three")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Count:"))

    class Failing:  # stands in for the "Invalid prefix encountered" some byte-fallback vocabularies hit
        def step(self, *_):
            raise Exception("Invalid prefix encountered")

    detok._stream = Failing()
    text = detok.add(ids) + detok.flush()
    assert text.strip() == "one two three"
