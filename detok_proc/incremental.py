"""Incremental detokenization: token ids in, text deltas out.

Deltas never contain broken UTF-8 (a character split over several tokens, or byte-fallback tokens, is
held until complete; HF tokenizers' `DecodeStream` does the decoding), and stop strings are found across
token boundaries: text that could still become the start of a stop string is held back until the next
tokens decide, so a client never sees part of a stop string it asked not to see.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens given to the decoder as context, so the first output token decodes as it would in
# the middle of the text (leading-space rules of SentencePiece/byte-level tokenizers).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ):
        self._tokenizer = tokenizer.backend_tokenizer  # the Rust tokenizer behind a HF fast tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # the output text so far (cut at a stop string once one is found)
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        self._sent = 0  # characters of `text` already returned as deltas

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add(self, token_ids: list[int]) -> str:
        """Feed newly generated tokens; return the text that is now safe to send."""
        for token_id in token_ids:
            if self.stopped:
                break
            chunk = self._step(token_id)
            if chunk:
                before = len(self.text)
                self.text += chunk
                self._find_stop(before)
        end = len(self.text) if self.stopped else len(self.text) - self._undecided_tail()
        delta = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception:  # noqa: BLE001 - tokenizers raises "Invalid prefix encountered" on some
            # byte-fallback sequences; start a fresh stream rather than fail the request (as vLLM does)
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer, token_id)

    def flush(self) -> str:
        """The request finished: whatever was held back is final now."""
        delta = self.text[self._sent :]
        self._sent = len(self.text)
        return delta

    def _find_stop(self, previous_length: int) -> None:
        """Cut `text` at the earliest stop string that the new chunk completed."""
        best = None
        for stop in self.stop:
            start = max(0, previous_length - len(stop) + 1)
            index = self.text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            index, stop = best
            self.text = self.text[: index + (len(stop) if self.include_stop_str_in_output else 0)]
            self.stop_reason = stop

    def _undecided_tail(self) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
