"""Loading a model's tokenizer and rendering its chat template (no torch needed): the tokenizer process,
the engine's grammar backend and the offline API all use it, so it lives at the lowest of their layers."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from pathlib import Path

from pagoda.engine_core.gguf_model import gguf_model_dir, is_gguf_file
from pagoda.engine_core.tool_prompt import messages_with_tools, template_renders_tools
from pagoda.engine_core.validation import ParamError


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of a model directory, or of a .gguf file (through the directory made from it)."""
    from transformers import AutoTokenizer

    if is_gguf_file(Path(model_dir)):
        model_dir = gguf_model_dir(Path(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> str:
    """The model's own jinja chat template applied to `messages`, as text. `tools` (OpenAI's shape)
    go to the template, or into the system message when the template ignores them (tool_prompt.py)."""
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use a plain completion prompt")
    kwargs = dict(chat_template_kwargs or {})
    taken = sorted(_server_arguments(type(tokenizer).apply_chat_template) & kwargs.keys())
    if taken:
        raise ParamError(
            f"Invalid 'chat_template_kwargs': {', '.join(map(repr, taken))} cannot be set there "
            "(the server sets it, or the request has a field of its own for it).",
            "chat_template_kwargs",
        )
    if tools:
        if template_renders_tools(tokenizer):
            kwargs["tools"] = tools
        else:
            messages = messages_with_tools(messages, tools)
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        **kwargs,
    )


@cache
def _server_arguments(apply_chat_template: Callable) -> frozenset[str]:
    """apply_chat_template's own parameters (tokenize, chat_template, tools, ...) and the template's
    `messages`: the server sets them, so a request's chat_template_kwargs may not; `documents` is a
    template variable."""
    parameters = inspect.signature(apply_chat_template).parameters
    own = {name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD and name not in ("self", "documents")}
    return frozenset(own | {"messages"})  # what the template receives the conversation as


def encode_chat(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    # The template already holds any BOS/special tokens: do not add them again.
    return tokenizer.encode(render_chat(tokenizer, messages, **kwargs), add_special_tokens=False)
