"""Refusing prompts that cannot fit before paying to tokenize all of them.

Tokenizing costs time and memory in proportion to the text (a 31 MB prompt took a minute and 4 GB), so
a size check that needs the token count comes too late to protect the server. Two cheaper checks come
first:

1. **The length bound.** No token covers more bytes of UTF-8 than its vocabulary string holds, with
   byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: one vocabulary character per byte) and SentencePiece
   (Llama 2, Mistral) alike. So a prompt of more than `token_limit x longest token` bytes cannot fit,
   and is refused from its length alone: one `len` per string, nothing ordinary requests notice.
   (Characters a tokenizer drops make this a heuristic for texts made of them: WordPiece drops
   whitespace, and SmolLM2's tokenizer some control characters. Such a text is no prompt anyway.)
2. **The probe.** The bound is loose (80 bytes per token for SmolLM2, where English averages 4-5), so
   a prompt longer than PROBE_BYTES_PER_TOKEN characters per token of the limit has its beginning
   tokenized first: if that alone comes to twice the limit, the whole cannot fit (a cut changes the
   tokens near it only), and the rest is never tokenized. Refusing any prompt then costs at most about
   `token_limit x PROBE_BYTES_PER_TOKEN` bytes of tokenizing, plus full tokenization only for texts
   made of unusually long tokens, which the bound limits.
"""

from __future__ import annotations

from pagoda.engine_core import protocol

PROBE_BYTES_PER_TOKEN = 16


class PromptTooLong(ValueError):
    """The prompt cannot fit in the token limit; the message says why, with the numbers."""


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest text one token can stand for."""
    vocabulary = tokenizer.get_vocab()
    if _byte_level(tokenizer):  # one character per byte: the string's length is the byte count
        return max((len(token) for token in vocabulary), default=1) or 1
    return max((len(token.encode("utf-8", "surrogatepass")) for token in vocabulary), default=1) or 1


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


def text_bytes(text: str) -> int:
    """UTF-8 length; free for ASCII text (CPython knows a string is ASCII without looking)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def prompt_bytes(request: protocol.PromptRequest) -> int:
    """Bytes of text the tokenizer would see: the prompt, or every string in the messages, tools and
    template variables (the template adds a little of its own; that only helps)."""
    if request.prompt is not None:
        return text_bytes(request.prompt)
    if request.messages is None:
        return 0
    chat = request.chat or protocol.ChatOptions()
    return _string_bytes([request.messages, chat.tools, chat.chat_template_kwargs])


def _string_bytes(value: object) -> int:
    """Total length of the strings (keys included) in a nested value; iterative, for any depth."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += text_bytes(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def check_length_bound(num_bytes: int, token_limit: int, max_token_bytes: int) -> None:
    """Refuse a prompt of more bytes than `token_limit` tokens can cover (PromptTooLong)."""
    most = token_limit * max_token_bytes
    if num_bytes > most:
        raise PromptTooLong(
            f"The prompt has {num_bytes} bytes of text; no prompt longer than {most} bytes fits in {token_limit} "
            f"tokens with this model's tokenizer (its longest token covers {max_token_bytes} bytes). Please "
            "reduce the length of the prompt."
        )


def encode_within(tokenizer, text: str, token_limit: int, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text)`, unless the probe shows the text cannot fit (PromptTooLong)."""
    probe = token_limit * PROBE_BYTES_PER_TOKEN
    if len(text) > probe:  # (characters: a head of `probe` of them holds at least `probe` bytes)
        head = tokenizer.encode(text[:probe], add_special_tokens=add_special_tokens)
        if len(head) > 2 * token_limit:
            raise PromptTooLong(
                f"The prompt has more than {2 * token_limit} tokens (its first {probe} characters alone have "
                f"{len(head)}); it cannot fit in {token_limit} tokens. Please reduce the length of the prompt."
            )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
