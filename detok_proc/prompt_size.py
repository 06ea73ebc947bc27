"""Refusing prompts that cannot fit before paying to tokenize them.

Tokenizing costs time and memory in proportion to the text (a 31 MB prompt took a minute and 4 GB), so
a size check that needs the token count comes too late to protect the server. But no tokenizer turns
a text into fewer tokens than its length divided by its longest token: with byte-level BPE (GPT-2,
Llama 3, Qwen, SmolLM) and SentencePiece (Llama 2, Mistral) alike, every token covers at most as many
characters as its vocabulary string is long. So a prompt longer than `token_limit x longest token`
characters cannot fit, and is refused from its length alone. (Tokenizers that drop characters, such
as WordPiece's whitespace and control characters, make this a heuristic for them; nothing this
engine generates with uses one.) The bound is loose, 20x what English text needs, and costs one
`len` per string: ordinary requests never notice it.
"""

from __future__ import annotations

from engine_core import protocol


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary string (bytes, for byte-level BPE's byte alphabet)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def prompt_chars(request: protocol.PromptRequest) -> int:
    """Characters of text the tokenizer would see: the prompt, or every string in the messages,
    tools and template variables (the template adds a little of its own; that only helps)."""
    if request.prompt is not None:
        return len(request.prompt)
    if request.messages is None:
        return 0
    chat = request.chat or protocol.ChatOptions()
    return _string_chars([request.messages, chat.tools, chat.chat_template_kwargs])


def _string_chars(value: object) -> int:
    """Total length of the strings (keys included) in a nested value; iterative, for any depth."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total
