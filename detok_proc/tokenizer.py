"""Loading a model's tokenizer and rendering its chat template (no torch needed)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> str:
    """The model's own jinja chat template applied to `messages`, as text."""
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use a plain completion prompt")
    return tokenizer.apply_chat_template(
        messages, tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, **(chat_template_kwargs or {}))


def encode_chat(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    # The template already holds any BOS/special tokens: do not add them again.
    return tokenizer.encode(render_chat(tokenizer, messages, **kwargs), add_special_tokens=False)
